"""The JAX internals the fusion pass relies on, in one place.

The pass re-traces sub-jaxprs (a ``shard_map`` body, a ``scan`` body, ...) the way JAX's own
control-flow rules do, which the public API does not offer: ``jax.make_jaxpr`` cannot take
avals that vary over manual axes, and a ``shard_map`` body must be traced inside its axis
environment and manual mesh. It also reads a ``custom_vjp`` call's backward rule. Each
internal is looked up here when first needed; a JAX release that moved one gets a clear
error naming the versions this code was written for, instead of an AttributeError deep in
a trace.
"""

from __future__ import annotations

import contextlib
import importlib

import jax

WRITTEN_FOR = "0.10"
TESTED_JAX = "0.10.2 and 0.11.2"


class MissingJaxInternal(RuntimeError):
    """A JAX internal the fusion pass needs is absent from the installed JAX."""


class UnsupportedJax(RuntimeError):
    """The installed JAX is older than the fusion pass needs."""


def require_supported_jax() -> None:
    """UnsupportedJax naming the JAX needed when the installed one is older than WRITTEN_FOR:
    the pass reads jaxprs through APIs of that release (``jax.extend.core.DropVar`` is public
    from JAX 0.10), so an older JAX would fail deep inside a trace with an AttributeError.
    The fused op itself runs on older releases (``jax_fusedar.MIN_JAX``)."""
    from jax_fusedar import MIN_JAX

    need = tuple(int(part) for part in WRITTEN_FOR.split("."))
    if tuple(jax.__version_info__[: len(need)]) < need:
        raise UnsupportedJax(
            f"jax_fusedar.fuse needs JAX >= {WRITTEN_FOR}, found jax {jax.__version__}: pip "
            f"install -U 'jax>={WRITTEN_FOR}', or call jax_fusedar.allreduce_fusion in the "
            f"model directly (it runs on JAX >= {MIN_JAX})"
        )


def _advice(what: str) -> str:
    return (
        f"jax_fusedar.fuse needs {what}, which JAX {jax.__version__} does not have; the "
        f"fusion pass was written for JAX {WRITTEN_FOR} (tested on {TESTED_JAX}): install "
        f"jax=={WRITTEN_FOR}.*, or call jax_fusedar.allreduce_fusion in the model directly"
    )


def internal(module: str, name: str):
    """``module.name`` of JAX's internals, or MissingJaxInternal naming the JAX needed."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise MissingJaxInternal(_advice(f"{module}.{name}")) from None


def trace_to_jaxpr(fun, in_avals, debug_info):
    """(jaxpr, consts) of ``fun`` traced at ``in_avals`` in the current context (axis
    environment, abstract mesh): JAX's own staging routine, as its control-flow primitives
    use it."""
    pe = importlib.import_module("jax._src.interpreters.partial_eval")
    if hasattr(pe, "trace_to_jaxpr_dynamic"):
        wrap_init = internal("jax._src.linear_util", "wrap_init")
        jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
            wrap_init(fun, debug_info=debug_info), list(in_avals)
        )
        return jaxpr, consts
    # Newer JAX: the FlatTree-based routine that replaced it.
    flat_tree = internal("jax._src.tree_util", "FlatTree")
    trace = internal("jax._src.interpreters.partial_eval", "trace_to_jaxpr")
    closed, _ = trace(fun, flat_tree.flatten((tuple(in_avals), {})), debug_info)
    return closed.jaxpr, closed.consts


@contextlib.contextmanager
def shard_map_body_context(mesh, manual_axes, check_vma):
    """The context shard_map traces its body in: its manual axes bound (psum and the fused
    op look their sizes up), the manual abstract mesh, its check_vma setting."""
    extend_axis_env_nd = internal("jax._src.core", "extend_axis_env_nd")
    from jax.sharding import AxisType, use_abstract_mesh

    manual_all = set(manual_axes) | set(getattr(mesh, "manual_axes", ()))
    inner = mesh.abstract_mesh.update_axis_types({n: AxisType.Manual for n in manual_axes})
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            extend_axis_env_nd([(k, v) for k, v in mesh.shape.items() if k in manual_all])
        )
        stack.enter_context(use_abstract_mesh(inner))
        config = importlib.import_module("jax._src.config")
        if hasattr(config, "_check_vma"):
            stack.enter_context(config._check_vma(check_vma))
        yield


def scan_layout(eqn) -> tuple[int, int]:
    """(number of loop constants, number of carries) of a ``scan`` eqn, whose operands are
    constants, carries, then scanned inputs, and whose body returns the carries first.
    JAX 0.10 records the counts as ``num_consts`` / ``num_carry``; newer releases (0.11)
    record the grouping as flat trees ``ft_in`` (constants, carries, scanned inputs) and
    ``ft_out`` (carries, outputs), whose groups give the same counts."""
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:
        return int(p["num_consts"]), int(p["num_carry"])
    if "ft_in" in p:
        try:
            consts, carry, _ = p["ft_in"].update(list(eqn.invars)).unpack()
            return len(list(consts)), len(list(carry))
        except (AttributeError, TypeError, ValueError):
            pass
    raise MissingJaxInternal(_advice("a scan's num_consts / num_carry (or ft_in) parameters"))


def dead_code_eliminated(jaxpr, used_outputs):
    """(jaxpr returning only the outputs ``used_outputs`` marks, without what they do not
    need; which of its inputs it still reads): JAX's own dead-code elimination, into nested
    calls (a checkpoint's, a scan's) as JAX does when it lowers a program."""
    dce = internal("jax._src.interpreters.partial_eval", "dce_jaxpr")
    return dce(jaxpr, list(used_outputs))


def closed_body(jaxpr):
    """A control-flow body as a ClosedJaxpr (JAX 0.10 stores a scan's body closed; newer
    releases store the open Jaxpr, its constants passed as operands)."""
    from jax.extend.core import ClosedJaxpr

    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr
    if getattr(jaxpr, "constvars", ()):
        raise MissingJaxInternal(_advice("a scan body without constvars"))
    return ClosedJaxpr(jaxpr, [])


def debug_info(what: str):
    """The debug info of a jaxpr fuse makes of no user function (``what`` names it; the
    names of its arguments unknown, as JAX gives them for such a jaxpr)."""
    return internal("jax._src.linear_util", "DebugInfo")("jax_fusedar.fuse", what, None, None)


def jaxpr_inliner():
    """``inline(eqns, read, write) -> bool`` that records equations unchanged into the
    jaxpr being traced now, as JAX inlines a jitted function's equations
    (``inline_jaxpr_into_trace``): their inputs are ``read`` from the rewrite's
    environment, their outputs ``write``-n to it, without binding each primitive again
    (no abstract evaluation, no staging rule: what makes a re-trace cost as much as the
    user's own trace). It declines (False, nothing recorded; the caller binds them) unless
    every input is this trace's tracer of exactly the type the equation read (so the
    recorded types stay true), or a concrete array of that type, and no equation has an
    effect. None where no jaxpr is being traced, or this JAX lacks the routine."""
    try:
        jcore_ = importlib.import_module("jax._src.core")
        pe = importlib.import_module("jax._src.interpreters.partial_eval")
        source_info_util = importlib.import_module("jax._src.source_info_util")
        inline_into = pe.inline_jaxpr_into_trace
        trace = jcore_.trace_ctx.trace
        tracer_type, jaxpr_type, drop = pe.DynamicJaxprTracer, jcore_.Jaxpr, jcore_.DropVar
        debug = debug_info("<equations the rewrite keeps>")
    except (ImportError, AttributeError, MissingJaxInternal):
        return None
    if not isinstance(trace, pe.DynamicJaxprTrace):
        return None
    src = source_info_util.current()

    def inline(eqns, read, write) -> bool:
        if any(e.effects for e in eqns):
            return False
        defined, free = set(), {}
        for e in eqns:
            for a in e.invars:
                if isinstance(a, jcore_.Var) and a not in defined:
                    free.setdefault(a, None)
            defined.update(e.outvars)
        invars, args, constvars, consts = [], [], [], []
        for v in free:
            x = read(v)
            if isinstance(x, tracer_type):
                if x._trace is not trace or x.aval != v.aval:
                    return False
                invars.append(v)
                args.append(x)
            elif isinstance(x, jax.Array) and not isinstance(x, jcore_.Tracer):
                if jcore_.typeof(x) != v.aval:
                    return False
                constvars.append(v)
                consts.append(x)
            else:
                return False
        outvars = [v for e in eqns for v in e.outvars if not isinstance(v, drop)]
        jaxpr = jaxpr_type(constvars, invars, outvars, eqns, debug_info=debug)
        for v, out in zip(outvars, inline_into(trace, src, jaxpr, consts, *args)):
            write(v, out)
        return True

    return inline


def axis_name_effects(effects) -> set:
    """The effects among ``effects`` that only record which named axes a jaxpr reads
    (``NamedAxisEffect``): bookkeeping that depends on where a body was traced (JAX drops
    them at the ``shard_map`` that binds the axes), not on what the body computes."""
    kind = internal("jax._src.core", "NamedAxisEffect")
    return {e for e in effects if isinstance(e, kind)}


def bind_params(eqn, params):
    """(subfuns, params) with which ``eqn.primitive`` is bound again with ``params``."""
    out = eqn.primitive.get_bind_params(params)
    if isinstance(out, tuple):  # (subfuns, params): call-like primitives of this JAX
        return out
    return (), out  # custom rules keep their functions in params["subfuns"]


def eqn_context(eqn):
    """The context manager an eqn was recorded under (its ``ctx``), or a null one."""
    return eqn.ctx.manager if hasattr(eqn, "ctx") else contextlib.nullcontext()


class CustomVJPParts:
    """The pieces of a ``custom_vjp_call`` eqn: how many residuals its forward rule saves,
    and its backward rule as a function of (residuals..., cotangents...)."""

    def __init__(self, eqn):
        params = eqn.params
        for key in ("bwd", "out_trees", "fwd_jaxpr_thunk", "call_jaxpr"):
            if key not in params:
                raise MissingJaxInternal(_advice(f"a custom_vjp_call's {key!r} parameter"))
        self.num_consts = int(params.get("num_consts", 0))
        self._bwd = params["bwd"]
        self._out_trees = params["out_trees"]
        self._fwd_thunk = params["fwd_jaxpr_thunk"]
        self.n_in = len(eqn.invars)

    def num_residuals(self) -> int:
        # The forward rule's jaxpr (traced as JAX does when differentiating) fills out_trees.
        self._fwd_thunk.call_wrapped(*([True] * (self.n_in - self.num_consts)))
        _, res_tree, _ = self._out_trees()
        return res_tree.num_leaves

    def backward(self, residuals, cotangents):
        """The rule's cotangents for the eqn's inputs (zeros where it gives none)."""
        zero_type = internal("jax._src.ad_util", "Zero")
        outs = self._bwd.call_wrapped(*residuals, *cotangents)
        # JAX 0.11's flattened rule returns (cotangents, logs); 0.10's the cotangents.
        if isinstance(outs, tuple) and len(outs) == 2 and isinstance(outs[0], list):
            if outs[1] is None or isinstance(outs[1], dict):
                outs = outs[0]
        return [
            jax.numpy.zeros(o.aval.shape, o.aval.dtype) if isinstance(o, zero_type) else o
            for o in outs
        ]
