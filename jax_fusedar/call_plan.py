"""The trace-time kernel decision every op on a workspace makes: the plan it carries as a
primitive parameter, whether the kernel can serve a call (or why not), one-shot, two-shot or
the large-message algorithm, and the fallback (logged once per kind of reason, or raised in
strict mode) with what it computes (``FALLBACKS``).

A call the kernel does not serve (every call on CPU, the xla backend, a call beyond the
workspace or the kernel's limits) runs its fallback, one rule for the dense op, the MoE ops
and the plain-jit entry alike:

* ``"xla"`` (the default, on every platform): what the user would have written, one
  ``psum`` of the input in its own dtype, then the residual add and RMSNorm at the kernel's
  rounding points (``reference.fallback_allreduce``). It moves exactly the bytes of the
  user's psum, and its sum is XLA's all-reduce (docs/numerics.md states its bound), so a
  site ``fuse`` rewrote runs the original program's own collective where no kernel serves it.
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
    fallback: str = "xla"  # what a call the kernel does not serve computes (FALLBACKS)


# What a call the kernel does not serve computes (module docstring); the first is the default.
FALLBACKS = ("xla", "kernel_exact")


def as_fallback(value) -> str:
    """The ``fallback=`` option, checked (never coerced): one of ``FALLBACKS``."""
    if isinstance(value, str) and value in FALLBACKS:
        return value
    raise ValueError(
        f"fallback must be one of {FALLBACKS} ('xla': XLA's all-reduce in the input's dtype, "
        f"as unfused code does; 'kernel_exact': the kernel's additions emulated, at up to "
        f"2 x world size times the bytes), got {value!r}"
    )


def served_by_kernel(plan: CallPlan, tokens: int, hidden: int, dtype_name: str) -> bool:
    """Whether the dense kernel serves a call of ``tokens`` rows on this plan (never logs
    or raises: the caller decides what a fallback means for it)."""
    return (
        plan.backend == "trtllm"
        and tokens > 0
        and kernel_problem(tokens, hidden, dtype_name, plan.sizes) is None
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
