"""The JAX front's side of a call's plan: it describes the call to the rules layer
(``common.plan``, the one decision both fronts share), carries what the decision reads as a
primitive parameter (``CallPlan``), and applies its policy to a call the kernel does not
serve: its fallback (``FALLBACKS``), logged once per kind of reason, or raised in strict
mode.

A call the kernel does not serve (every call on CPU, the xla backend, a call beyond the
workspace or the kernel's limits, an empty call) runs its fallback, one rule for the dense
op, the MoE ops and the plain-jit entry alike:

* ``"xla"`` (the default, on every platform): what the user would have written, one
  ``psum`` of the input in its own dtype, then the residual add and RMSNorm at the kernel's
  rounding points (``reference.fallback_allreduce``). It moves exactly the bytes of the
  user's psum, and its sum is XLA's all-reduce (docs/numerics.md states its bound), so a
  site ``fuse`` rewrote runs the original program's own collective where no kernel serves it.
* ``"xla_plain"``: the same psum, its residual add and RMSNorm written as unfused code
  writes them (the add in T, the norm's result converted to T: ``reference.convert_to``):
  the same values wherever XLA performs every rounding
  (``--xla_allow_excess_precision=false``), otherwise XLA may keep excess precision there
  as it may in that code; less to compile than ``"xla"``'s explicit roundings. ``fuse``
  emits it: a site it rewrote costs, where no kernel serves it, what the original did to
  run and to compile.
* ``"kernel_exact"``: the kernel's additions emulated (``reference.allreduce_sum``): with
  ``fp32_acc`` a float32 psum (twice the bytes of a 16-bit psum), without it one float32
  psum per rank (2 x world size times the bytes). For kernel-identical numbers on a fallback
  (the CPU parity and oracle tests), asked for per call.

Every decision is a pure function of the plan and the call's shape, so every rank of a group
decides alike and the kernel's spin-wait always finds its peers. The batching rules call the
same functions again for the folded token count.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

from ..common import backend_choice, plan as rules, sizing
from ..common.patterns import AllReduceFusionPattern

log = logging.getLogger("jax_fusedar")
# Kinds of fallback reason already logged: one warning per kind and process, not per shape
# (a model with many sequence lengths would otherwise log every one).
_fallback_reasons_logged: set = set()

DENSE = AllReduceFusionPattern.kARResidualRMSNorm  # the dense patterns share one rule


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What the trace-time kernel decision reads besides the call's shape, carried as a
    parameter of the primitive so that its batching rule can decide again for the token
    count of the folded batch."""

    backend: str
    sizes: sizing.WorkspaceSizes
    strict: bool
    use_oneshot: Optional[bool]  # as requested: None picks by size
    fallback: str = "xla"  # what a call the kernel does not serve computes (FALLBACKS)


# What a call the kernel does not serve computes (module docstring); the first is the default.
FALLBACKS = ("xla", "kernel_exact", "xla_plain")


def as_fallback(value) -> str:
    """The ``fallback=`` option, checked (never coerced): one of ``FALLBACKS``."""
    if isinstance(value, str) and value in FALLBACKS:
        return value
    raise ValueError(
        f"fallback must be one of {FALLBACKS} ('xla': XLA's all-reduce in the input's dtype, "
        f"as unfused code does; 'kernel_exact': the kernel's additions emulated, at up to "
        f"2 x world size times the bytes; 'xla_plain': as 'xla', rounding by plain "
        f"conversions), got {value!r}"
    )


def served_by_kernel(plan: CallPlan, tokens: int, hidden: int, dtype_name: str) -> bool:
    """Whether the dense kernel serves a call of ``tokens`` rows on this plan (``common.plan``'s
    rule; never logs or raises: the caller decides what a fallback means for it)."""
    return (
        plan.backend == "trtllm" and kernel_problem(tokens, hidden, dtype_name, plan.sizes) is None
    )


NO_KERNEL_HERE = "left as is: no kernel here"


def fused_site_problem(
    workspace, tokens: int, hidden: int, dtype_name: str, *, adds_collectives: bool
) -> Optional[str]:
    """For ``jax_fusedar.fuse``: why a site must stay as written although its fused call
    would be exact, or None. Where the kernel does not serve the fused call (an xla-backend
    workspace, e.g. CPU or TP across hosts), the call runs the "xla" fallback, which is the
    original's own collective (one psum in the site's dtype): as costly as the original, and
    the same all-reduce. A rewrite that ``adds_collectives`` around the fused call (sequence
    parallelism gathers the residual and all-reduces every token instead of a reduce-scatter
    and an all-gather) would cost more there than the program it replaces."""
    plan = CallPlan(workspace.backend, workspace.sizes, False, None)
    if not adds_collectives or served_by_kernel(plan, tokens, hidden, dtype_name):
        return None
    problem = kernel_problem(tokens, hidden, dtype_name, workspace.sizes)
    why = (
        f"the workspace is on the {workspace.backend} backend"
        if workspace.backend != "trtllm"
        else problem[1]
    )
    return (
        f"{NO_KERNEL_HERE} ({why}): without the kernel the fused form would gather the "
        "residual and all-reduce every token, more than the reduce-scatter and all-gather "
        "it replaces"
    )


def fallback(kind: str, reason: str, strict: bool, backend: str) -> None:
    """The kernel cannot serve a call: raise in strict mode, else log ``reason`` (once per
    ``kind`` and process) and let the caller run the reference."""
    if strict:
        raise ValueError(
            f"jax_fusedar: cannot use the fused kernel: {reason} (strict mode; "
            f"unset {backend_choice.STRICT_ENV_VAR} or pass strict=False to fall "
            "back to psum + RMSNorm)"
        )
    # The xla backend never uses the kernel: nothing falls back there, nothing to report.
    if backend == "trtllm" and kind not in _fallback_reasons_logged:
        _fallback_reasons_logged.add(kind)
        log.warning(
            "jax_fusedar: falling back to psum + RMSNorm: %s (logged once per kind "
            "of reason; set %s=1 to raise instead)",
            reason,
            backend_choice.STRICT_ENV_VAR,
        )


def describe(
    plan: CallPlan,
    tokens: int,
    hidden: int,
    dtype_name: str,
    pattern=DENSE,
    *,
    layout: int = 0,
    group_size: int = 0,
    moe_allreduce_out: bool = False,
) -> rules.Call:
    """The call as the rules layer takes it; ``tokens``: every row of the call (the
    product of x's leading dims, or of the folded batch)."""
    return rules.Call(
        pattern=AllReduceFusionPattern(pattern),
        tokens=int(tokens),
        hidden=int(hidden),
        dtype=dtype_name,
        sizes=plan.sizes,
        backend=plan.backend,
        use_oneshot=plan.use_oneshot,
        layout=int(layout),
        group_size=int(group_size),
        moe_allreduce_out=bool(moe_allreduce_out),
    )


# Kinds of plan the fallback serves without a word, even in strict mode: a workspace of the
# xla backend never uses the kernel; an empty call has nothing to reduce, so its empty
# result is exact and costs nothing (strict mode guards the kernel's speed, and there is
# none to lose). torch_compat refuses an empty call, as FlashInfer's launch fails there.
SILENT = (rules.XLA_BACKEND, rules.EMPTY)


def decide(plan: CallPlan, call: rules.Call) -> rules.Plan:
    """The call's plan, after this front's policy for a call the kernel does not serve
    (``fallback``, but for the ``SILENT`` kinds)."""
    decided = rules.plan_call(call)
    if not decided.kernel and decided.kind not in SILENT:
        reason = decided.reason
        if decided.kind == rules.TOO_SMALL:
            reason += "; every row of an N-D or vmapped call counts"
        fallback(decided.kind, reason, plan.strict, plan.backend)
    return decided


def plan_dense(
    workspace,
    pattern,
    x_shape,
    dtype_name: str,
    *,
    use_oneshot,
    strict: bool,
    layout,
    group_size,
    fallback: str = "xla",
):
    """(CallPlan, Plan) of a dense call on ``workspace`` for x of ``x_shape`` (``[...,
    hidden]``: every leading dim is a token dim), its options as ``allreduce_fusion``
    validated them; logs or raises per ``strict`` where the kernel does not serve it."""
    plan = CallPlan(
        workspace.backend,
        workspace.sizes,
        strict,
        None if use_oneshot is None else bool(use_oneshot),
        fallback,
    )
    tokens, hidden = math.prod(x_shape[:-1]), x_shape[-1]
    call = describe(plan, tokens, hidden, dtype_name, pattern, layout=layout, group_size=group_size)
    return plan, decide(plan, call)


def plan_moe(
    workspace,
    pattern,
    rows_shape,
    *,
    strict: bool,
    allreduce_out: bool = False,
    fallback: str = "xla",
):
    """(CallPlan, Plan) of an MoE call on ``workspace`` whose residual rows have
    ``rows_shape`` (``[..., hidden]``); logs or raises per ``strict`` where the kernel does
    not serve it. The MoE kernels are one-shot only (use_oneshot True)."""
    plan = CallPlan(workspace.backend, workspace.sizes, strict, True, fallback)
    tokens, hidden = math.prod(rows_shape[:-1]), rows_shape[-1]
    call = describe(
        plan, tokens, hidden, workspace.dtype.name, pattern, moe_allreduce_out=allreduce_out
    )
    return plan, decide(plan, call)


def kernel_problem(
    tokens: int, hidden: int, dtype_name: str, sizes: sizing.WorkspaceSizes, pattern=DENSE
) -> Optional[tuple]:
    """(kind, why) the kernel cannot serve a call of this shape (``common.plan``'s rule),
    or None; nothing logged."""
    call = rules.Call(AllReduceFusionPattern(pattern), int(tokens), int(hidden), dtype_name, sizes)
    return rules.kernel_problem(call)


def choose_path(plan: CallPlan, tokens: int, hidden: int, dtype_name: str, pattern=DENSE, **kw):
    """(use_kernel, algorithm code) of the dense op for a call of ``tokens`` rows (logs or
    raises per ``plan.strict`` where the kernel cannot serve it)."""
    decided = decide(plan, describe(plan, tokens, hidden, dtype_name, pattern, **kw))
    return decided.kernel, decided.algorithm_code


def choose_moe_kernel(
    plan: CallPlan, tokens: int, hidden: int, dtype_name: str, pattern=None, **kw
) -> bool:
    """Whether an MoE call runs the kernel (logs or raises per ``plan.strict`` when it
    cannot; the rule is ``common.moe_limits``, through ``common.plan``, shared with torch and
    the native launch)."""
    pattern = AllReduceFusionPattern.kMoEReductionARResidualRMSNorm if pattern is None else pattern
    return decide(plan, describe(plan, tokens, hidden, dtype_name, pattern, **kw)).kernel
