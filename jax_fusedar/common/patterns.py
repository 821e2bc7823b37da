"""FlashInfer's fusion patterns and scale-factor layouts, with what each one reads and writes.

Framework-neutral (no jax or torch import): the one table of every pattern (``TRAITS``), the
dense kernel's and the MoE epilogues' alike, with the family that serves each (``family``:
which op, which launcher, which XLA handler) and the operands of its call in the handler's
order (``operand_names``). The JAX ops and the torch layer derive their inputs and outputs
from it (their result shapes through ``results.result_specs``). Its native twin is
ffi/core/include/fusedar/patterns.h (the launch checks and the XLA handlers' operand and
result counts); tests/native/test_contract.py holds the two equal.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from . import arguments


class AllReduceFusionPattern(enum.IntEnum):
    """FlashInfer's ``AllReduceFusionPattern`` codes (trtllm_allreduce_fusion.cuh)."""

    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormFP4Quant = 3
    kARResidualRMSNormOutFP8Quant = 4
    kARResidualRMSNormOutFP4Quant = 5
    # FlashInfer's MoE epilogues (trtllm_moe_allreduce_fusion.cuh): their own inputs (the
    # families "moe_reduction" and "moe_finalize" of TRAITS), served by
    # jax_fusedar.moe_reduction_allreduce_fusion / moe_finalize_allreduce_fusion and by
    # torch_compat.allreduce_fusion (jax_fusedar/ops/moe.py, torch_compat/moe.py).
    kMoEReductionARResidualRMSNorm = 6
    kMoEFinalizeARResidualRMSNorm = 7
    kARResidualRMSNormPerTokenGroupFP8PackedQuant = 8
    kARResidualRMSNormOutPerTokenGroupFP8PackedQuant = 9
    kARResidualRMSNormDynamicFP8Quant = 10
    kARResidualRMSNormOutDynamicFP8Quant = 11


class QuantizationSFLayout(enum.IntEnum):
    """FlashInfer's NVFP4 scale-factor layouts. SWIZZLED_8x4 is not implemented by the kernel."""

    SWIZZLED_128x4 = 0
    SWIZZLED_8x4 = 1
    LINEAR = 2


# The families of patterns: which op, launcher and XLA handler serve a pattern. "dense": the
# dense kernel (FlashInfer's allreduce_fusion); the MoE epilogues: "moe_reduction" (the
# expert-weighted sum of pattern 6), "moe_finalize" (the gather of permuted expert rows of 7).
FAMILIES = ("dense", "moe_reduction", "moe_finalize")

# Every operand a family's call can take, in its XLA handler's order (ffi/xla/
# allreduce_fusion.cc, moe_allreduce_fusion.cc); ``operand_names`` picks one call's. The
# names are the frameworks' argument names (FlashInfer's for the MoE rows).
FAMILY_OPERANDS = {
    "dense": ("x", "residual", "rms_gamma", "scale_factor"),
    "moe_reduction": ("expert_scales", "expert_outputs", "token_input", "residual", "rms_gamma"),
    "moe_finalize": (
        "permuted_input",
        "expanded_idx_to_permuted_idx",
        "residual",
        "rms_gamma",
        "expert_scale_factor",  # when given
        "shared_expert_output",  # when given
    ),
}
# The operands a call may leave out (the finalize's), by name.
OPTIONAL_OPERANDS = ("expert_scale_factor", "shared_expert_output")


@dataclasses.dataclass(frozen=True)
class PatternTraits:
    has_allreduce_out: bool
    has_residual: bool  # reads residual_in + rms_gamma, writes residual_out
    has_norm_out: bool
    quant: Optional[str]  # None, "fp8", "fp4", "group_fp8", "dynamic_fp8"
    family: str = "dense"  # FAMILIES

    @property
    def is_moe(self) -> bool:
        return self.family != "dense"

    @property
    def optional_allreduce_out(self) -> bool:
        """Pattern 6 writes the all-reduced combine too when asked (FlashInfer's ``output=``)."""
        return self.family == "moe_reduction"

    @property
    def uses_scale_factor(self) -> bool:
        return self.quant in ("fp8", "fp4")

    @property
    def writes_scale_out(self) -> bool:
        return self.quant in ("fp4", "group_fp8", "dynamic_fp8")

    @property
    def needs_sm100(self) -> bool:
        """On sm90 the NVFP4 epilogue compiles and runs but writes zeros and no scales."""
        return self.quant == "fp4"


P = AllReduceFusionPattern
TRAITS = {
    P.kAllReduce: PatternTraits(True, False, False, None),
    P.kARResidualRMSNorm: PatternTraits(False, True, True, None),
    P.kARResidualRMSNormFP8Quant: PatternTraits(False, True, False, "fp8"),
    P.kARResidualRMSNormFP4Quant: PatternTraits(False, True, False, "fp4"),
    P.kARResidualRMSNormOutFP8Quant: PatternTraits(False, True, True, "fp8"),
    P.kARResidualRMSNormOutFP4Quant: PatternTraits(False, True, True, "fp4"),
    P.kARResidualRMSNormPerTokenGroupFP8PackedQuant: PatternTraits(False, True, False, "group_fp8"),
    P.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant: PatternTraits(
        False, True, True, "group_fp8"
    ),
    P.kARResidualRMSNormDynamicFP8Quant: PatternTraits(False, True, False, "dynamic_fp8"),
    P.kARResidualRMSNormOutDynamicFP8Quant: PatternTraits(False, True, True, "dynamic_fp8"),
    P.kMoEReductionARResidualRMSNorm: PatternTraits(False, True, True, None, "moe_reduction"),
    P.kMoEFinalizeARResidualRMSNorm: PatternTraits(False, True, True, None, "moe_finalize"),
}
TRAITS = dict(sorted(TRAITS.items()))  # by code, as the native table lists them
del P

# The dense kernel's patterns (one launcher, one handler, kernels/compiled_patterns.h) and the
# MoE epilogues'.
DENSE_PATTERNS = tuple(p for p, t in TRAITS.items() if t.family == "dense")
MOE_PATTERNS = tuple(p for p, t in TRAITS.items() if t.is_moe)

SM100_PATTERNS = tuple(int(p) for p, t in TRAITS.items() if t.needs_sm100)


def device_problem(pattern, device: str, major: int, minor: int) -> Optional[str]:
    """Why ``pattern`` cannot run on ``device`` (a label for the message) of compute
    capability ``major.minor``, or None. The native launch refuses the same (launch.cpp)."""
    if TRAITS[as_pattern(pattern)].needs_sm100 and int(major) < 10:
        return (
            f"NVFP4 patterns ({', '.join(map(str, SM100_PATTERNS))}) need an sm100+ GPU "
            f"(Blackwell); {device} is sm{int(major)}{int(minor)}"
        )
    return None


def operand_names(
    pattern, *, expert_scale_factor: bool = False, shared_expert_output: bool = False
) -> tuple:
    """The operands of a call of ``pattern``, by name, in its XLA handler's order: the dense
    patterns' ``x [, residual, rms_gamma] [, scale_factor]`` by their traits, the MoE ones'
    ``FAMILY_OPERANDS`` with the optional ones the call gives."""
    traits = TRAITS[as_pattern(pattern)]
    if traits.family == "dense":
        return (
            ("x",)
            + ("residual", "rms_gamma") * traits.has_residual
            + ("scale_factor",) * traits.uses_scale_factor
        )
    given = {
        "expert_scale_factor": expert_scale_factor,
        "shared_expert_output": shared_expert_output,
    }
    return tuple(n for n in FAMILY_OPERANDS[traits.family] if given.get(n, True))


def _valid_codes() -> str:
    # Built only for an error message: as_pattern runs on every eager torch call.
    return ", ".join(f"{q.value} ({q.name})" for q in AllReduceFusionPattern)


def as_pattern(pattern) -> AllReduceFusionPattern:
    """Validates a pattern code, naming the valid ones when it is not (12 is FlashInfer's
    MNNVL-only code). Only an
    ``AllReduceFusionPattern`` or an int is a code: 1.9, "1" or True are refused, not
    truncated or parsed into pattern 1."""
    if isinstance(pattern, AllReduceFusionPattern):
        return pattern
    if not arguments.is_int(pattern):
        raise ValueError(
            f"unknown fusion pattern {pattern!r}: pattern must be an "
            f"AllReduceFusionPattern or its int code, not a "
            f"{type(pattern).__name__}; valid codes: {_valid_codes()}"
        )
    try:
        return AllReduceFusionPattern(int(pattern))
    except ValueError:
        raise ValueError(
            f"unknown fusion pattern {pattern!r}; valid codes: {_valid_codes()}"
        ) from None
