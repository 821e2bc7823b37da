"""An FX pass that fuses all-reduce -> residual add -> RMSNorm into one custom-op call.

In the spirit of vLLM's ``AllReduceFusionPass``: it works on ATen-level graphs (``make_fx``
output, or inductor's post-grad graph, via :func:`install` /
:class:`AllReduceFusionPass`) and rewrites every block of the form::

    ar  = _c10d_functional.all_reduce(x, "sum", group_name)     # funcol; group = workspace's
    t   = _c10d_functional.wait_tensor(ar)                       # only used by the add
    r   = aten.add.Tensor(t, residual)        # either operand order; residual same shape/dtype
    out = RMSNorm(r, gamma, eps)

into::

    fused = torch_compat.allreduce_residual_rmsnorm(x, residual, gamma, eps, 0.0, None,
                                                    False, workspace_handle)
    r'    = fused[0]     # replaces every use of r   (residual_out)
    out'  = fused[1]     # replaces every use of out (norm_out)

where ``RMSNorm`` is one of

* ``aten.rms_norm.default(r, [H], gamma, eps)`` (``F.rms_norm`` kept whole), or
* ``aten._fused_rms_norm.default(r, [H], gamma, eps)[0]`` (what ``F.rms_norm`` becomes on
  CUDA undecomposed; its second output, rstd, must be unused), or
* its decomposition, which is also the hand-written form (vLLM's ``forward_native``)::

      rf = r            or  a cast of r to float32 (aten._to_copy / prims.convert_element_type
                                                    / aten.to)
      v  = mean(rf ** 2 (pow 2 or rf*rf), dim=[-1], keepdim=True)
      n  = rf * rsqrt(v + eps)              (add/add_, Tensor or Scalar; mul in either order)
      out = cast(n * gamma)  or  cast(n) * gamma  or  n * gamma   (the casts optional)

  The eps must be a Python number, gamma a tensor node of shape [H] with x's dtype, and the
  final ``out`` must have x's dtype.

A block is rewritten only when all of these hold, otherwise it is left untouched:

* the all-reduce is a ``"sum"`` over the workspace's group (``group_name`` given to the
  pass, or, when none is, the group the name resolves to has the workspace's global ranks);
* the shapes are static, x is 2-D [M, H] (the kernel's layout) with x, residual and the
  result sharing dtype, and ``workspace.is_buffer_size_sufficient(world_size, M, H, dtype)``;
* every intermediate node (the all-reduce, the wait, the norm's internals) has no user
  outside the block (``r`` itself may have any users: they get ``residual_out``).

Numerics: the kernel adds in the input dtype and normalizes in float32, like the decomposed
``F.rms_norm``; the float32-add variants (``x.float() + residual.float()``) are not matched.
"""

from __future__ import annotations

import logging
import numbers
import operator
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx

from jax_fusedar.common import arguments

from . import library
from .workspace import TorchAllReduceFusionWorkspace

log = logging.getLogger("torch_compat.fusion_pass")

aten = torch.ops.aten
prims = torch.ops.prims
_funcol = getattr(torch.ops, "_c10d_functional")

_ALL_REDUCE = (_funcol.all_reduce.default,)
_WAIT = (_funcol.wait_tensor.default,)
_ADD = (aten.add.Tensor, aten.add.Scalar, aten.add_.Tensor, aten.add_.Scalar)
_MUL = (aten.mul.Tensor,)
_CASTS = (aten._to_copy.default, prims.convert_element_type.default, aten.to.dtype)
_RMS_NORM = tuple(op for op in (getattr(aten, "rms_norm", None),) if op is not None)
_RMS_NORM = tuple(op.default for op in _RMS_NORM)
# What F.rms_norm becomes on CUDA when it is not decomposed: (output, rstd).
_FUSED_RMS_NORM = tuple(
    op.default for op in (getattr(aten, "_fused_rms_norm", None),) if op is not None
)


def _val(n: Any):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _static_shape(n: fx.Node) -> Optional[tuple]:
    v = _val(n)
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return tuple(int(s) for s in v.shape)
    except (TypeError, ValueError):  # a SymInt without a value: dynamic
        return None
    # (an unbacked/symbolic size raises in int())


def _is_static(n: fx.Node) -> bool:
    v = _val(n)
    return isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape)


def _dtype(n: fx.Node):
    v = _val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _is(n: Any, targets: Sequence) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _only_user(n: fx.Node) -> Optional[fx.Node]:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _other(node: fx.Node, one: fx.Node) -> Any:
    """The other operand of a binary node that has ``one`` as an operand."""
    a, b = node.args[0], node.args[1]
    if a is one and b is not one:
        return b
    if b is one and a is not one:
        return a
    return None


def _cast_dtype(n: fx.Node):
    """The target dtype of a cast node (None if it is not a plain dtype cast)."""
    if n.target is prims.convert_element_type.default:
        return n.args[1]
    if n.target is aten.to.dtype:
        return n.args[1] if len(n.args) > 1 else n.kwargs.get("dtype")
    if n.target is aten._to_copy.default:
        extra = set(n.kwargs) - {"dtype", "layout", "device", "memory_format"}
        return None if extra or len(n.args) > 1 else n.kwargs.get("dtype")
    return None


class _Match:
    def __init__(self, ar, wait, add, residual, gamma, eps, out, internals):
        self.ar, self.wait, self.add, self.residual = ar, wait, add, residual
        self.gamma, self.eps, self.out, self.internals = gamma, eps, out, internals


def _match_normalize(r: fx.Node, rf: fx.Node):
    """rf * rsqrt(mean(rf**2, -1, keepdim) + eps): (sq, mean, add, rsqrt, mul, eps) or None."""
    ndim = len(_static_shape(r))
    for sq in rf.users:
        if not (
            (_is(sq, (aten.pow.Tensor_Scalar,)) and sq.args[0] is rf and sq.args[1] == 2)
            or (_is(sq, _MUL) and sq.args[0] is rf and sq.args[1] is rf)
        ):
            continue
        mean = _only_user(sq)
        if not _is(mean, (aten.mean.dim,)) or mean.args[0] is not sq:
            continue
        dims = list(mean.args[1]) if len(mean.args) > 1 else mean.kwargs.get("dim")
        keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        if dims not in ([-1], [ndim - 1]) or not keep or mean.kwargs.get("dtype") is not None:
            continue
        add_eps = _only_user(mean)
        if (
            not _is(add_eps, _ADD)
            or add_eps.args[0] is not mean
            or not isinstance(add_eps.args[1], numbers.Real)
            or add_eps.kwargs.get("alpha", 1) != 1
        ):
            continue
        rsqrt = _only_user(add_eps)
        if not _is(rsqrt, (aten.rsqrt.default,)):
            continue
        mul_n = _only_user(rsqrt)
        if not _is(mul_n, _MUL) or _other(mul_n, rsqrt) is not rf:
            continue
        return sq, mean, add_eps, rsqrt, mul_n, float(add_eps.args[1])
    return None


def _match_norm(r: fx.Node):
    """Matches an RMSNorm of ``r``; returns (gamma, eps, out node, internal nodes) or None.
    Internal nodes are every node of the norm but ``out`` (and ``r``)."""
    for u in r.users:
        if _is(u, _RMS_NORM + _FUSED_RMS_NORM):
            args = list(u.args) + [None] * 4
            shape, gamma, eps = (
                args[1],
                args[2],
                args[3] if len(u.args) > 3 else u.kwargs.get("eps"),
            )
            gamma = gamma if gamma is not None else u.kwargs.get("weight")
            if not (
                isinstance(gamma, fx.Node)
                and isinstance(eps, numbers.Real)
                and list(shape or ()) == [_static_shape(r)[-1]]
            ):
                return None
            if _is(u, _RMS_NORM):
                return gamma, float(eps), u, []
            # _fused_rms_norm: the output is its only user, getitem 0 (rstd unused).
            users = list(u.users)
            if len(users) == 1 and users[0].target is operator.getitem and users[0].args[1] == 0:
                return gamma, float(eps), users[0], [u]
            return None
    # Decomposed form. rf: r or a float32 cast of r.
    cands = [r] + [u for u in r.users if _is(u, _CASTS) and _cast_dtype(u) == torch.float32]
    for rf in cands:
        found = _match_normalize(r, rf)
        if found is not None:
            break
    else:
        return None
    sq, mean, add_eps, rsqrt, mul_n, eps = found
    internals = [] if rf is r else [rf]
    internals += [sq, mean, add_eps, rsqrt, mul_n]
    # Then: [cast] -> mul gamma -> [cast].
    cur = mul_n
    nxt = _only_user(cur)
    if _is(nxt, _CASTS) and _cast_dtype(nxt) is not None:
        internals.append(cur)
        cur = nxt
        nxt = _only_user(cur)
    if not _is(nxt, _MUL):
        return None
    gamma = _other(nxt, cur)
    if not isinstance(gamma, fx.Node):
        return None
    internals.append(cur)
    cur = nxt
    nxt = _only_user(cur)
    if _is(nxt, _CASTS) and _cast_dtype(nxt) is not None:
        internals.append(cur)
        cur = nxt
    internals = list(dict.fromkeys(n for n in internals if n is not cur))
    return gamma, eps, cur, internals


def _group_matches(
    group_name: Any, workspace: TorchAllReduceFusionWorkspace, expected: Optional[str]
) -> bool:
    if expected is not None:
        return group_name == expected
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(group_name)
        return tuple(dist.get_process_group_ranks(pg)) == tuple(workspace.global_ranks)
    except Exception as e:  # noqa: BLE001 - an unresolvable group is simply not ours
        log.debug("cannot resolve group %r: %s", group_name, e)
        return False


def _match(ar: fx.Node, workspace, group_name: Optional[str]) -> Optional[_Match]:
    if len(ar.args) < 3 or ar.args[1] != "sum":
        return None
    x = ar.args[0]
    if not isinstance(x, fx.Node) or not _group_matches(ar.args[2], workspace, group_name):
        return None
    wait = _only_user(ar)
    if not _is(wait, _WAIT) or wait.args[0] is not ar:
        return None
    add = _only_user(wait)
    if not _is(add, (aten.add.Tensor,)) or add.kwargs.get("alpha", 1) != 1:
        return None
    residual = _other(add, wait)
    if not isinstance(residual, fx.Node):
        return None
    shape = _static_shape(x)
    if shape is None or len(shape) != 2 or not _is_static(x):
        return None
    dtype = _dtype(x)
    if (
        _static_shape(residual) != shape
        or _dtype(residual) != dtype
        or _static_shape(add) != shape
        or _dtype(add) != dtype
    ):
        return None
    norm = _match_norm(add)
    if norm is None:
        return None
    gamma, eps, out, internals = norm
    if (
        _static_shape(gamma) != (shape[1],)
        or _dtype(gamma) != dtype
        or _static_shape(out) != shape
        or _dtype(out) != dtype
    ):
        return None
    block = {ar, wait, add, out, *internals}
    for n in internals:
        if any(u not in block for u in n.users):
            return None
    if not workspace.is_buffer_size_sufficient(workspace.world_size, shape[0], shape[1], dtype):
        return None
    return _Match(ar, wait, add, residual, gamma, eps, out, internals)


def fuse_allreduce_rmsnorm_graph(
    graph: fx.Graph,
    workspace: TorchAllReduceFusionWorkspace,
    *,
    group_name: Optional[str] = None,
    workspace_handle: Optional[int] = None,
) -> int:
    """Rewrites ``graph`` in place (see the module docstring); returns the replacement
    count. ``workspace_handle`` defaults to ``library.register_workspace(workspace)``."""
    handle = (
        None if workspace_handle is None else arguments.as_int("workspace_handle", workspace_handle)
    )
    count = 0
    # Match and rewrite one block at a time: block k+1's residual is block k's r, which the
    # rewrite of block k replaces, so matches are taken on the graph as it is now.
    for ar in [n for n in graph.nodes if _is(n, _ALL_REDUCE)]:
        m = _match(ar, workspace, group_name)
        if m is None:
            continue
        if handle is None:
            handle = library.register_workspace(workspace)
        order = {n: i for i, n in enumerate(graph.nodes)}
        # The fused call goes right after the last of its inputs and the add it replaces,
        # so every user of r (residual_out) and of the norm's output comes after it.
        anchor = max((m.add, m.gamma, m.residual, m.ar.args[0]), key=order.__getitem__)
        if any(order[u] <= order[anchor] for u in m.add.users):
            log.debug("not fusing %s: r is used before gamma is computed", m.ar)
            continue
        with graph.inserting_after(anchor):
            fused = graph.call_function(
                library.ALLREDUCE_RESIDUAL_RMSNORM,
                (m.ar.args[0], m.residual, m.gamma, m.eps, 0.0, None, False, handle),
            )
        with graph.inserting_after(fused):
            norm_out = graph.call_function(operator.getitem, (fused, 1))
        with graph.inserting_after(fused):
            res_out = graph.call_function(operator.getitem, (fused, 0))
        rv, nv = _val(m.add), _val(m.out)
        if rv is not None and nv is not None:
            fused.meta["val"] = (rv, nv)
            res_out.meta["val"], norm_out.meta["val"] = rv, nv
        m.add.replace_all_uses_with(res_out)
        m.out.replace_all_uses_with(norm_out)
        for n in [m.out, *reversed(m.internals), m.add, m.wait, m.ar]:
            if not n.users:
                graph.erase_node(n)
        count += 1
    graph.lint()
    log.info("fused %d all-reduce + residual + RMSNorm block(s)", count)
    return count


def fuse_allreduce_rmsnorm(
    gm: fx.GraphModule,
    workspace: TorchAllReduceFusionWorkspace,
    *,
    group_name: Optional[str] = None,
    workspace_handle: Optional[int] = None,
) -> int:
    """:func:`fuse_allreduce_rmsnorm_graph` on a GraphModule, recompiling it when changed."""
    count = fuse_allreduce_rmsnorm_graph(
        gm.graph, workspace, group_name=group_name, workspace_handle=workspace_handle
    )
    if count:
        gm.recompile()
    return count


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Base
except Exception:  # noqa: BLE001 - older torch
    _Base = object


class AllReduceFusionPass(_Base):
    """The pass as an inductor custom post-grad pass (``torch._inductor.config.
    post_grad_custom_pre_pass``); see :func:`install`. ``count`` sums the replacements."""

    def __init__(
        self, workspace: TorchAllReduceFusionWorkspace, *, group_name: Optional[str] = None
    ):
        self.workspace = workspace
        self.group_name = group_name
        self.handle = library.register_workspace(workspace)
        self.count = 0

    def __call__(self, graph: Union[fx.Graph, fx.GraphModule]) -> None:
        if isinstance(graph, fx.GraphModule):
            self.count += fuse_allreduce_rmsnorm(
                graph, self.workspace, group_name=self.group_name, workspace_handle=self.handle
            )
        else:
            self.count += fuse_allreduce_rmsnorm_graph(
                graph, self.workspace, group_name=self.group_name, workspace_handle=self.handle
            )

    def uuid(self) -> Any:
        # Part of inductor's cache key: the pass's code version and what it bakes in.
        ws = self.workspace
        return (
            "torch_compat.AllReduceFusionPass/1",
            self.handle,
            self.group_name,
            ws.world_size,
            tuple(ws.global_ranks),
            ws.max_token_num,
            ws.hidden_dim,
            str(ws.dtype),
        )


def install(
    workspace: TorchAllReduceFusionWorkspace, *, group_name: Optional[str] = None
) -> AllReduceFusionPass:
    """Sets ``torch._inductor.config.post_grad_custom_pre_pass`` to the fusion pass for
    ``workspace`` (replacing any pass there) and returns it. Use
    ``torch._inductor.config.patch(post_grad_custom_pre_pass=AllReduceFusionPass(ws))`` for
    a scoped install instead."""
    import torch._inductor.config as cfg

    p = AllReduceFusionPass(workspace, group_name=group_name)
    cfg.post_grad_custom_pre_pass = p
    return p
