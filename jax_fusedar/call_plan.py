"""The JAX front's side of a call's plan: it describes the call to the rules layer
(``common.plan``, the one decision both fronts share), carries what the decision reads as a
primitive parameter (``CallPlan``), and applies its policy to a call the kernel does not
serve: the reference (psum + RMSNorm), logged once per kind of reason, or raised in strict
mode.

Every decision is a pure function of the plan and the call's shape, so every rank of a group
decides alike and the kernel's spin-wait always finds its peers. The batching rules call the
same functions again for the folded token count.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

from .common import backend_choice, plan as rules, sizing
from .common.patterns import AllReduceFusionPattern

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


def decide(plan: CallPlan, call: rules.Call) -> rules.Plan:
    """The call's plan, after this front's policy for a call the kernel does not serve
    (``fallback``; a workspace of the xla backend never uses the kernel, nothing to say)."""
    decided = rules.plan_call(call)
    if not decided.kernel and decided.kind != rules.XLA_BACKEND:
        reason = decided.reason
        if decided.kind == rules.TOO_SMALL:
            reason += "; every row of an N-D or vmapped call counts"
        fallback(decided.kind, reason, plan.strict, plan.backend)
    return decided


def plan_dense(
    workspace, pattern, x_shape, dtype_name: str, *, use_oneshot, strict: bool, layout, group_size
):
    """(CallPlan, Plan) of a dense call on ``workspace`` for x of ``x_shape`` (``[...,
    hidden]``: every leading dim is a token dim), its options as ``allreduce_fusion``
    validated them; logs or raises per ``strict`` where the kernel does not serve it."""
    plan = CallPlan(
        workspace.backend,
        workspace.sizes,
        strict,
        None if use_oneshot is None else bool(use_oneshot),
    )
    tokens, hidden = math.prod(x_shape[:-1]), x_shape[-1]
    call = describe(plan, tokens, hidden, dtype_name, pattern, layout=layout, group_size=group_size)
    return plan, decide(plan, call)


def plan_moe(workspace, pattern, rows_shape, *, strict: bool, allreduce_out: bool = False):
    """(CallPlan, Plan) of an MoE call on ``workspace`` whose residual rows have
    ``rows_shape`` (``[..., hidden]``); logs or raises per ``strict`` where the kernel does
    not serve it. The MoE kernels are one-shot only (use_oneshot True)."""
    plan = CallPlan(workspace.backend, workspace.sizes, strict, True)
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
