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
* its decomposition, which is also the hand-written form::

      rf = a cast of r to float32 (aten._to_copy / prims.convert_element_type / aten.to),
           or r itself in a float32 graph
      v  = mean(rf ** 2 (pow 2 or rf*rf), dim=[-1], keepdim=True)
      n  = rf * rsqrt(v + eps)              (add/add_, Tensor or Scalar; mul in either order)
      out = cast_T(n * gamma)               (gamma in T, or its float32 cast)

  The eps must be a Python number, gamma a tensor node of shape [H] with x's dtype, and the
  final ``out`` must have x's dtype.

Exact or absent. By default a block is rewritten only where the fused op rounds exactly
where the graph does: the residual add in T, the norm in float32 from that T sum, gamma
multiplied in float32, one rounding to T at the end. On the same inputs the rewritten graph
then gives the bits of the original wherever the fused op's float32 arithmetic is the
graph's (the CPU stand-in of the tests; on GPUs within the kernel's own error,
docs/numerics.md). Forms that round elsewhere are rewritten only with
``allow_rounding_change=True``, and each such block names its change in
``Block.rounding_change``:

* ``out = cast_T(n) * gamma`` (Hugging Face's ``LlamaRMSNorm`` / ``Qwen2RMSNorm``, vLLM's
  ``rms_norm`` native form): gamma multiplied after the norm is rounded to T;
* ``t.float() + residual.float()`` rounded to T for the residual stream with the norm
  computed from the unrounded float32 sum (vLLM's ``fused_add_rms_norm``): the fused op
  normalizes the T sum (its ``residual_out`` is the graph's rounded sum, bit for bit).

The bound an opted-in block keeps is in docs/torch.md. Never fused: a norm computed in T
(the statistics not in float32), a float32 gamma, a norm without gamma.

A block is rewritten only when all of these hold, otherwise it is left untouched (each
all-reduce gets a :class:`Block` in ``report`` with the reason):

* the all-reduce is a ``"sum"`` over the workspace's group (``group_name`` given to the
  pass, or, when none is, the group the name resolves to has the workspace's global ranks);
* the shapes are static, x is 2-D [M, H] (the kernel's layout) with x, residual and the
  result sharing dtype, and ``workspace.is_buffer_size_sufficient(world_size, M, H, dtype)``;
* every intermediate node (the all-reduce, the wait, the norm's internals) has no user
  outside the block (``r`` itself may have any users: they get ``residual_out``).
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import operator
from typing import Any, List, Optional, Sequence, Union

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


class _Skip(Exception):
    """Why a block is left as written (``Block.reason``)."""


class _Match:
    def __init__(self, ar, wait, add, residual, gamma, eps, out, internals, change, gone=()):
        self.ar, self.wait, self.add, self.residual = ar, wait, add, residual
        self.gamma, self.eps, self.out, self.internals = gamma, eps, out, internals
        self.rounding_change = change
        self.gone = list(gone)  # nodes between the all-reduce and the add (float32 form)


@dataclasses.dataclass(frozen=True)
class Block:
    """One all-reduce the pass looked at: ``where`` names its node, ``fused`` says whether
    it was rewritten, ``reason`` why not, ``rounding_change`` what the rewrite rounds
    differently from the graph (only with ``allow_rounding_change``; None: bit-exact)."""

    where: str
    fused: bool
    reason: Optional[str] = None
    rounding_change: Optional[str] = None

    def line(self) -> str:
        if not self.fused:
            return f"{self.where}: not fused: {self.reason}"
        change = f" (rounding change: {self.rounding_change})" if self.rounding_change else ""
        return f"{self.where}: fused{change}"


def _dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


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


def _gamma_root(g: Any, T) -> Any:
    """gamma's node in T behind ``g`` (a widening cast of a T tensor keeps its value)."""
    if _is(g, _CASTS) and _cast_dtype(g) == torch.float32 and _dtype(g.args[0]) == T:
        return g.args[0]
    return g


def _match_tail(mul_n: fx.Node, T):
    """From the float32 normalized value to the norm's output: casts and one multiplication
    by gamma, in either order. Returns (gamma, out, nodes before out, rounding change) or
    raises _Skip. Exact: gamma multiplied in float32, then one rounding to T (the fused op's
    order); multiplying after a rounding to T is a rounding change."""
    cur, nodes, gamma, rounded, change = mul_n, [], None, False, None
    while True:
        nxt = _only_user(cur)
        if nxt is None:
            break
        if _is(nxt, _CASTS) and _cast_dtype(nxt) is not None:
            to = _cast_dtype(nxt)
            if to not in (T, torch.float32):
                break
            if to == T and _dtype(cur) == torch.float32 and T != torch.float32:
                rounded = True
        elif gamma is None and _is(nxt, _MUL) and isinstance(_other(nxt, cur), fx.Node):
            g = _other(nxt, cur)
            if _static_shape(g) is None or len(_static_shape(g)) != 1:
                break
            gamma = _gamma_root(g, T)
            if rounded:
                where = _dname(_dtype(nxt))
                change = f"gamma multiplied in {where} after the norm is rounded to {_dname(T)}"
        else:
            break
        nodes.append(cur)
        cur = nxt
        if gamma is not None and _dtype(cur) == T and (rounded or T == torch.float32):
            break
    if gamma is None:
        raise _Skip("no gamma multiplies the normalized value (the kernel needs gamma)")
    if _dtype(cur) != T:
        raise _Skip(f"the norm output is not cast back to {_dname(T)}")
    if _dtype(gamma) != T:
        raise _Skip(f"gamma is {_dname(_dtype(gamma))} (the kernel reads gamma in {_dname(T)})")
    return gamma, cur, nodes, change


def _match_norm(r: fx.Node, rf_given: Optional[fx.Node], T):
    """Matches an RMSNorm of ``r``; returns (gamma, eps, out node, internal nodes, rounding
    change) or raises _Skip. Internal nodes are every node of the norm but ``out`` (and
    ``r``). ``rf_given``: the float32 value the norm reads, when it is not a cast of ``r``
    (the float32 residual add)."""
    if rf_given is None:
        for u in r.users:
            if _is(u, _RMS_NORM + _FUSED_RMS_NORM):
                args = list(u.args) + [None] * 4
                shape, gamma = args[1], args[2]
                eps = args[3] if len(u.args) > 3 else u.kwargs.get("eps")
                gamma = gamma if gamma is not None else u.kwargs.get("weight")
                if not isinstance(gamma, fx.Node):
                    raise _Skip("the RMSNorm has no weight (the kernel needs gamma)")
                if not isinstance(eps, numbers.Real):
                    raise _Skip("the RMSNorm's eps is not a Python number")
                if list(shape or ()) != [_static_shape(r)[-1]]:
                    raise _Skip("the RMSNorm does not normalize the last axis alone")
                if _dtype(gamma) != T:
                    raise _Skip(
                        f"gamma is {_dname(_dtype(gamma))} (the kernel reads gamma in {_dname(T)})"
                    )
                # aten.rms_norm / _fused_rms_norm: float32 math, gamma in float32, one
                # rounding (torch's decomposition), as the fused op.
                if _is(u, _RMS_NORM):
                    return gamma, float(eps), u, [], None
                # _fused_rms_norm: the output is its only user, getitem 0 (rstd unused).
                users = list(u.users)
                if (
                    len(users) == 1
                    and users[0].target is operator.getitem
                    and users[0].args[1] == 0
                ):
                    return gamma, float(eps), users[0], [u], None
                raise _Skip("the RMSNorm's rstd is used (the fused op does not return it)")
        cands = [r] + [u for u in r.users if _is(u, _CASTS) and _cast_dtype(u) == torch.float32]
    else:
        cands = [rf_given]
    for rf in cands:
        found = _match_normalize(r, rf)
        if found is not None:
            break
    else:
        raise _Skip("no RMSNorm of the residual sum")
    if _dtype(rf) != torch.float32:
        raise _Skip(f"RMSNorm computed in {_dname(T)}, not float32")
    sq, mean, add_eps, rsqrt, mul_n, eps = found
    internals = [] if rf is r or rf is rf_given else [rf]
    internals += [sq, mean, add_eps, rsqrt]
    gamma, out, tail, change = _match_tail(mul_n, T)
    internals = list(dict.fromkeys(n for n in internals + tail if n is not out))
    return gamma, eps, out, internals, change


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


def _residual_add(wait: fx.Node, T):
    """(add, residual, the float32 sum the norm reads or None, nodes it replaces): the
    residual add after the all-reduce, in T (``t + residual``), or in float32
    (``t.float() + residual.float()``, rounded to T for the residual stream: vLLM's
    ``fused_add_rms_norm``), which the fused op's residual_out equals (a float32 sum of two T
    values rounds to T as the T add does) but whose norm reads the unrounded sum."""
    nxt = _only_user(wait)
    if _is(nxt, (aten.add.Tensor,)) and nxt.kwargs.get("alpha", 1) == 1:
        residual = _other(nxt, wait)
        if isinstance(residual, fx.Node):
            return nxt, residual, None, []
    if (
        T != torch.float32
        and _is(nxt, _CASTS)
        and _cast_dtype(nxt) == torch.float32
        and _is(_only_user(nxt), (aten.add.Tensor,))
        and _only_user(nxt).kwargs.get("alpha", 1) == 1
    ):
        add32 = _only_user(nxt)
        other = _other(add32, nxt)
        if (
            _is(other, _CASTS)
            and _cast_dtype(other) == torch.float32
            and _dtype(other.args[0]) == T
        ):
            rounds = [u for u in add32.users if _is(u, _CASTS) and _cast_dtype(u) == T]
            if len(rounds) == 1:
                # In order of definition: erased in reverse, users first.
                gone = [nxt] + ([other] if len(other.users) == 1 else []) + [add32]
                return rounds[0], other.args[0], add32, gone
    raise _Skip("the all-reduce is not followed by a residual add (its only use)")


def _match(ar: fx.Node, workspace, group_name: Optional[str], allow: bool) -> _Match:
    """The block of the all-reduce ``ar``, or raises _Skip with the reason."""
    if len(ar.args) < 3 or ar.args[1] != "sum":
        raise _Skip("not a sum")
    x = ar.args[0]
    if not isinstance(x, fx.Node):
        raise _Skip("the all-reduce's input is not a graph value")
    if not _group_matches(ar.args[2], workspace, group_name):
        raise _Skip(f"the all-reduce's group {ar.args[2]!r} is not the workspace's")
    wait = _only_user(ar)
    if not _is(wait, _WAIT) or wait.args[0] is not ar:
        raise _Skip("the all-reduce has other uses than its wait")
    shape = _static_shape(x)
    if shape is None or len(shape) != 2 or not _is_static(x):
        raise _Skip("the all-reduce's input is not a static 2-D [tokens, hidden] tensor")
    dtype = _dtype(x)
    add, residual, rf, gone = _residual_add(wait, dtype)
    if (
        _static_shape(residual) != shape
        or _dtype(residual) != dtype
        or _static_shape(add) != shape
        or _dtype(add) != dtype
    ):
        raise _Skip("the residual's or the sum's shape or dtype is not the all-reduce's")
    gamma, eps, out, internals, change = _match_norm(add, rf, dtype)
    changes, why = [], []
    if rf is not None:
        changes.append("the norm reads the residual sum rounded to " + _dname(dtype))
        why.append(
            "the residual added in float32 and the norm computed on the unrounded sum (the "
            f"fused op normalizes the {_dname(dtype)} sum)"
        )
        internals = [n for n in internals if n not in gone]
    if change is not None:
        changes.append(change)
        why.append(change + " (the fused op rounds once, after it)")
    if changes and not allow:
        raise _Skip("; ".join(why) + ": allow_rounding_change=True fuses it")
    change = "; ".join(changes) or None
    if _static_shape(gamma) != (shape[1],) or _static_shape(out) != shape or _dtype(out) != dtype:
        raise _Skip("gamma is not [hidden] or the norm's output is not the sum's shape")
    block = {ar, wait, add, out, *internals, *gone}
    for n in internals + [n for n in gone if n is not add]:
        if any(u not in block for u in n.users):
            raise _Skip(f"{n.name}, inside the block, has a use outside it")
    if not workspace.is_buffer_size_sufficient(workspace.world_size, shape[0], shape[1], dtype):
        raise _Skip(f"{shape[0]} x {shape[1]} {_dname(dtype)} does not fit the workspace")
    return _Match(ar, wait, add, residual, gamma, eps, out, internals, change, gone)


def fuse_allreduce_rmsnorm_graph(
    graph: fx.Graph,
    workspace: TorchAllReduceFusionWorkspace,
    *,
    group_name: Optional[str] = None,
    workspace_handle: Optional[int] = None,
    allow_rounding_change: bool = False,
    report: Optional[List[Block]] = None,
) -> int:
    """Rewrites ``graph`` in place (see the module docstring); returns the replacement
    count. ``workspace_handle`` defaults to ``library.register_workspace(workspace)``.
    ``allow_rounding_change``: also fuse the blocks whose rounding differs from the fused
    op's (named in each block's ``rounding_change``; the bound is in docs/torch.md).
    ``report``: a list that gets one :class:`Block` per all-reduce looked at."""
    if not isinstance(allow_rounding_change, bool):
        raise TypeError(
            f"allow_rounding_change must be True or False, got {allow_rounding_change!r}"
        )
    handle = (
        None if workspace_handle is None else arguments.as_int("workspace_handle", workspace_handle)
    )
    count = 0
    blocks = []
    # Match and rewrite one block at a time: block k+1's residual is block k's r, which the
    # rewrite of block k replaces, so matches are taken on the graph as it is now.
    for ar in [n for n in graph.nodes if _is(n, _ALL_REDUCE)]:
        try:
            m = _match(ar, workspace, group_name, allow_rounding_change)
        except _Skip as e:
            blocks.append(Block(ar.name, False, str(e)))
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        # The fused call goes right after the last of its inputs and the add it replaces,
        # so every user of r (residual_out) and of the norm's output comes after it.
        anchor = max((m.add, m.gamma, m.residual, m.ar.args[0]), key=order.__getitem__)
        if any(order[u] <= order[anchor] for u in m.add.users):
            blocks.append(Block(ar.name, False, "the residual sum is used before gamma exists"))
            continue
        if handle is None:
            handle = library.register_workspace(workspace)
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
        for n in [m.out, *reversed(m.internals), m.add, *reversed(m.gone), m.wait, m.ar]:
            if not n.users:
                graph.erase_node(n)
        count += 1
        blocks.append(Block(ar.name, True, rounding_change=m.rounding_change))
    graph.lint()
    changed = sum(b.rounding_change is not None for b in blocks)
    log.info(
        "fused %d of %d all-reduce + residual + RMSNorm block(s)%s",
        count,
        len(blocks),
        f", {changed} with a rounding change" if changed else "",
    )
    for b in blocks:
        log.debug("%s", b.line())
    if report is not None:
        report.extend(blocks)
    return count


def fuse_allreduce_rmsnorm(
    gm: fx.GraphModule,
    workspace: TorchAllReduceFusionWorkspace,
    *,
    group_name: Optional[str] = None,
    workspace_handle: Optional[int] = None,
    allow_rounding_change: bool = False,
    report: Optional[List[Block]] = None,
) -> int:
    """:func:`fuse_allreduce_rmsnorm_graph` on a GraphModule, recompiling it when changed."""
    count = fuse_allreduce_rmsnorm_graph(
        gm.graph,
        workspace,
        group_name=group_name,
        workspace_handle=workspace_handle,
        allow_rounding_change=allow_rounding_change,
        report=report,
    )
    if count:
        gm.recompile()
    return count


def _register_as_inductor_pass(cls):
    """Makes ``cls`` a virtual subclass of inductor's CustomGraphPass (an ABC), which
    inductor needs to cache a graph compiled with it. Done on first use, not at import:
    ``torch._inductor`` takes longer to import than torch itself, and eager users of
    torch_compat never need it."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # a torch without it: inductor calls the pass all the same
        return
    if not issubclass(cls, CustomGraphPass):
        CustomGraphPass.register(cls)


class AllReduceFusionPass:
    """The pass as an inductor custom post-grad pass (``torch._inductor.config.
    post_grad_custom_pre_pass``); see :func:`install`. ``count`` sums the replacements,
    ``blocks`` lists every block looked at (:class:`Block`)."""

    def __init__(
        self,
        workspace: TorchAllReduceFusionWorkspace,
        *,
        group_name: Optional[str] = None,
        allow_rounding_change: bool = False,
    ):
        if not isinstance(allow_rounding_change, bool):
            raise TypeError(
                f"allow_rounding_change must be True or False, got {allow_rounding_change!r}"
            )
        _register_as_inductor_pass(type(self))
        self.workspace = workspace
        self.group_name = group_name
        self.allow_rounding_change = allow_rounding_change
        self.handle = library.register_workspace(workspace)
        self.count = 0
        self.blocks: List[Block] = []

    def __call__(self, graph: Union[fx.Graph, fx.GraphModule]) -> None:
        kw = dict(
            group_name=self.group_name,
            workspace_handle=self.handle,
            allow_rounding_change=self.allow_rounding_change,
            report=self.blocks,
        )
        if isinstance(graph, fx.GraphModule):
            self.count += fuse_allreduce_rmsnorm(graph, self.workspace, **kw)
        else:
            self.count += fuse_allreduce_rmsnorm_graph(graph, self.workspace, **kw)

    def uuid(self) -> Any:
        # Part of inductor's cache key: the pass's code version and what it bakes in.
        ws = self.workspace
        return (
            "torch_compat.AllReduceFusionPass/2",
            self.handle,
            self.group_name,
            self.allow_rounding_change,
            ws.world_size,
            tuple(ws.global_ranks),
            ws.max_token_num,
            ws.hidden_dim,
            str(ws.dtype),
        )


def install(
    workspace: TorchAllReduceFusionWorkspace,
    *,
    group_name: Optional[str] = None,
    allow_rounding_change: bool = False,
) -> AllReduceFusionPass:
    """Sets ``torch._inductor.config.post_grad_custom_pre_pass`` to the fusion pass for
    ``workspace`` (replacing any pass there) and returns it. Use
    ``torch._inductor.config.patch(post_grad_custom_pre_pass=AllReduceFusionPass(ws))`` for
    a scoped install instead."""
    import torch._inductor.config as cfg

    p = AllReduceFusionPass(
        workspace, group_name=group_name, allow_rounding_change=allow_rounding_change
    )
    cfg.post_grad_custom_pre_pass = p
    return p
