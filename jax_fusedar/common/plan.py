"""What one call does, decided once for both front ends: from a framework-neutral description
of the call (``Call``: pattern, tokens x hidden, dtype, the workspace's facts) to its
``Plan``: whether the kernel serves it, with which algorithm (one-shot, two-shot or the
large-message path), or why not; and the results it writes, in order. Framework-neutral
(never imports jax or torch).

The JAX API (``jax_fusedar/ops/plan.py``) and ``torch_compat`` (``ops``, ``moe``) translate
their arguments into a ``Call`` and act on the ``Plan``; neither decides anything itself.
What each does with a call the kernel does not serve is its own documented policy: JAX falls
back to psum + RMSNorm (logged once per kind of reason, or raised in strict mode; an empty
call silently), torch raises ValueError, as FlashInfer does. ``tests/jax/test_plan_fronts.py``
runs both fronts over a grid of calls and asserts they reach identical plans.

Every decision is a pure function of the ``Call``: every rank of a group computes the same
plan for the same call, so the kernel's spin-waits always find their peers (never feed it
anything rank-local: device, timing, free memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from . import launch_mode, limits, moe_limits, sizing
from .patterns import TRAITS, AllReduceFusionPattern, as_pattern
from .results import ResultSpec, result_specs

# The kinds of reason the kernel does not serve a call (the JAX front logs one warning per
# kind and process).
EMPTY = "empty input"
UNSUPPORTED_SHAPE = "unsupported shape"
UNSUPPORTED_DTYPE = "unsupported dtype"
TOO_SMALL = "workspace too small"
XLA_BACKEND = "xla backend"

# The dense patterns share one rule (the pattern decides only the results): the pattern a
# question without one is asked for, e.g. FlashInfer's is_buffer_size_sufficient.
DENSE_RULE = AllReduceFusionPattern.kARResidualRMSNorm

ALGORITHMS = tuple(launch_mode.ALGORITHM_NAMES.values())  # "twoshot", "oneshot", "large"
_ALGORITHM_CODES = {name: code for code, name in launch_mode.ALGORITHM_NAMES.items()}


@dataclass(frozen=True)
class Call:
    """One call as both front ends describe it. ``tokens`` counts every row the call reduces
    (JAX: the product of x's leading dims; torch: ``input.shape[0]``, the MoE patterns'
    ``residual_in.shape[0]``); ``dtype`` is the input's dtype name; ``sizes`` and ``backend``
    are the workspace's ("trtllm": the kernel, "xla": plain collectives); ``use_oneshot`` as
    the caller asked (None: by size); ``layout`` (NVFP4 scale layout) and ``group_size``
    (per-token-group FP8) as the front validated them, 0 where unused;
    ``moe_allreduce_out``: pattern 6 also writes the all-reduced combine."""

    pattern: AllReduceFusionPattern
    tokens: int
    hidden: int
    dtype: str
    sizes: sizing.WorkspaceSizes
    backend: str = "trtllm"
    use_oneshot: Optional[bool] = None
    layout: int = 0
    group_size: int = 0
    moe_allreduce_out: bool = False


@dataclass(frozen=True)
class Plan:
    """What a call does. ``kernel``: the kernel serves it. ``algorithm``: what the kernel
    runs (or would run on a "trtllm" workspace: "oneshot", "twoshot", "large"), None where
    it cannot run the call at all. ``kind`` and ``reason``: why the kernel does not serve it
    (None when it does). ``outputs``: the results, in the order the XLA handler writes them
    and JAX returns them (``results``)."""

    kernel: bool
    algorithm: Optional[str]
    kind: Optional[str]
    reason: Optional[str]
    outputs: Tuple[ResultSpec, ...]

    @property
    def algorithm_code(self) -> int:
        """The native launch's code (``launch_mode.ALGORITHM_*``); one-shot where the kernel
        cannot run the call (the code is then never launched)."""
        if self.algorithm is None:
            return launch_mode.ALGORITHM_ONESHOT
        return _ALGORITHM_CODES[self.algorithm]


def is_moe(pattern) -> bool:
    return TRAITS[as_pattern(pattern)].is_moe


def kernel_problem(call: Call) -> Optional[Tuple[str, str]]:
    """(kind, why) the kernel cannot serve ``call`` whatever the workspace's backend, or
    None: the one rule of the dense kernel and of the MoE kernels, for both front ends
    (the native launch checks the same: ffi/core/launch.cpp, moe_launch.cpp)."""
    if call.tokens == 0:
        # The kernel launches a cluster per token, so an empty call has no launch at all
        # (FlashInfer's launcher fails there with an invalid grid, the native core refuses
        # an empty input), and nothing to exchange.
        return EMPTY, f"the call is empty (0 tokens x hidden {call.hidden}): nothing to all-reduce"
    sizes = call.sizes
    if is_moe(call.pattern):
        return moe_limits.kernel_problem(call.tokens, call.hidden, call.dtype, sizes)
    problem = limits.kernel_support_problem(sizes.world_size, call.hidden, call.dtype)
    if problem is not None:
        return UNSUPPORTED_SHAPE, problem
    if (call.dtype == "float32") != sizes.use_fp32_lamport:
        # The Lamport buffer's empty marker is -0.0 at the workspace's element width.
        return UNSUPPORTED_DTYPE, (
            f"a {call.dtype} call needs a workspace of its element width, and this one was "
            f"created for {sizes.dtype_name} (float32 needs a float32 workspace, bfloat16 "
            f"and float16 a 16-bit one)"
        )
    if not sizing.buffer_fits(call.tokens, call.hidden, sizes):
        return TOO_SMALL, (
            f"{call.tokens}x{call.hidden} tokens exceed the workspace (max_token_num="
            f"{sizes.max_token_num} x hidden {sizes.hidden_dim})"
        )
    return None


def check_moe_mode(pattern, use_oneshot: Optional[bool]) -> None:
    """The MoE kernels are one-shot only: ``use_oneshot=False`` is refused (ValueError)."""
    if use_oneshot is False:
        raise ValueError(
            f"{as_pattern(pattern).name} is one-shot only (FlashInfer's MoE kernels have no "
            "two-shot variant); pass use_oneshot=None or True"
        )


def _algorithm(call: Call) -> str:
    """The algorithm of a call the kernel can run. Raises ValueError for a ``use_oneshot``
    it cannot run: an explicit mode is never degraded, on any backend."""
    if is_moe(call.pattern):
        check_moe_mode(call.pattern, call.use_oneshot)
        return "oneshot"
    code = launch_mode.choose_algorithm(call.tokens, call.hidden, call.sizes, call.use_oneshot)
    return launch_mode.ALGORITHM_NAMES[code]


def kernel_choice(call: Call) -> str:
    """ "oneshot" or "twoshot": the choice between FlashInfer's own two kernels for a dense
    call the kernel can run (FlashInfer's size heuristic, or the forced ``use_oneshot``),
    which is what ``plan_call`` runs wherever it does not take the large-message path.
    Passed explicitly to two builds of the kernel, it makes them run the same one (the torch
    benchmark against FlashInfer's own build). Raises ValueError where that mode cannot run
    the call."""
    oneshot = launch_mode.choose_oneshot(call.tokens, call.hidden, call.sizes, call.use_oneshot)
    return "oneshot" if oneshot else "twoshot"


def outputs(call: Call) -> Tuple[ResultSpec, ...]:
    """The results of ``call`` in order (``results.result_specs``)."""
    return result_specs(
        call.pattern,
        call.tokens,
        call.hidden,
        call.dtype,
        call.layout,
        call.group_size,
        call.moe_allreduce_out,
    )


def plan_call(call: Call) -> Plan:
    """The plan of ``call`` (module docstring). Raises ValueError where the call itself is
    wrong whatever serves it: a pattern this layer does not know, a forced ``use_oneshot``
    the kernel cannot run."""
    specs = outputs(call)
    problem = kernel_problem(call)
    if problem is not None:
        return Plan(False, None, problem[0], problem[1], specs)
    algorithm = _algorithm(call)
    if call.backend != "trtllm":
        why = f"the workspace's backend is {call.backend!r} (plain collectives, never the kernel)"
        return Plan(False, algorithm, XLA_BACKEND, why, specs)
    return Plan(True, algorithm, None, None, specs)
