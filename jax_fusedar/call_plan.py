"""The trace-time kernel decision every op on a workspace makes: the plan it carries as a
primitive parameter, whether the kernel can serve a call (or why not), one-shot, two-shot or
the large-message algorithm, and the fallback to the reference (logged once per kind of
reason, or raised in strict mode).

Every decision is a pure function of the plan and the call's shape, so every rank of a group
decides alike and the kernel's spin-wait always finds its peers. The batching rules call the
same functions again for the folded token count.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from .common import backend_choice, launch_mode, limits, moe_limits, sizing

log = logging.getLogger("jax_fusedar")
# Kinds of fallback reason already logged: one warning per kind and process, not per shape
# (a model with many sequence lengths would otherwise log every one).
_fallback_reasons_logged: set = set()


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


def kernel_problem(
    tokens: int, hidden: int, dtype_name: str, sizes: sizing.WorkspaceSizes
) -> Optional[tuple]:
    """(kind, why) the dense kernel cannot serve this call (then it falls back), or None."""
    problem = limits.kernel_support_problem(sizes.world_size, hidden, dtype_name)
    if problem is not None:
        return "unsupported shape", problem
    if not sizing.buffer_fits(tokens, hidden, sizes):
        return "workspace too small", (
            f"{tokens}x{hidden} tokens exceed the workspace (max_token_num="
            f"{sizes.max_token_num} x hidden {sizes.hidden_dim}; every row of an N-D or "
            "vmapped call counts)"
        )
    return None


def choose_path(plan: CallPlan, tokens: int, hidden: int, dtype_name: str):
    """(use_kernel, algorithm) of the dense op for a call of ``tokens`` rows (algorithm: a
    launch_mode.ALGORITHM_* code): a pure function of the plan and the shape, so every rank
    decides alike (logs or raises per ``plan.strict``)."""
    use_kernel = plan.backend == "trtllm"
    if tokens == 0:
        # Every rank has the same empty shape: nothing to exchange, the reference serves it.
        return False, launch_mode.ALGORITHM_ONESHOT
    problem = kernel_problem(tokens, hidden, dtype_name, plan.sizes)
    if problem is not None:
        fallback(*problem, plan.strict, plan.backend)
        return False, launch_mode.ALGORITHM_ONESHOT
    # Raises for an explicit use_oneshot the workspace cannot serve (never degrade).
    algorithm = launch_mode.choose_algorithm(tokens, hidden, plan.sizes, plan.use_oneshot)
    return use_kernel, algorithm


def choose_moe_kernel(plan: CallPlan, tokens: int, hidden: int, dtype_name: str) -> bool:
    """Whether an MoE call runs the kernel (logs or raises per ``plan.strict`` when it cannot;
    the rule is ``common.moe_limits``, shared with torch and the native launch)."""
    if tokens == 0:
        return False
    problem = moe_limits.kernel_problem(tokens, hidden, dtype_name, plan.sizes)
    if problem is not None:
        fallback(*problem, plan.strict, plan.backend)
        return False
    return plan.backend == "trtllm"
