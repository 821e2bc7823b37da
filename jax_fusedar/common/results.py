"""What one fused call writes: the name, shape and dtype of every result of a pattern.

The single source for JAX's abstract eval (``ops/dense.py``), the torch op's outputs and
fake implementation (``torch_compat/library.py``), the eager op's checks of the caller's
outputs (``torch_compat/ops.py``) and a call's plan (``plan.Plan.outputs``). The order is
the XLA handlers' (ffi/xla/allreduce_fusion.cc, its counts in fusedar/patterns.h):
allreduce_out, or residual_out [+ norm_out] [+ quant_out [+ scale_out]]; for the MoE
patterns (ffi/xla/moe_allreduce_fusion.cc) residual_out, norm_out [+ allreduce_out].
Framework-neutral (never imports jax or torch): dtypes are names both frameworks resolve
(``jnp.dtype(name)``, ``getattr(torch, name)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from . import quant_layouts
from .patterns import TRAITS, QuantizationSFLayout, as_pattern


@dataclass(frozen=True)
class ResultSpec:
    name: str  # allreduce_out, residual_out, norm_out, quant_out or scale_out
    shape: Tuple[int, ...]
    dtype: str
    # Element strides when the result is a strided view rather than a dense array: only the
    # per-token-group scales, FlashInfer's MN-major (M, K) view with strides (1, T) of a
    # dense (K, T) buffer (quant_layouts module docstring).
    strides: Optional[Tuple[int, ...]] = None

    @property
    def storage_shape(self) -> Tuple[int, ...]:
        """The dense row-major array that holds the result: ``shape`` itself, or for the
        (M, K) view with strides (1, T) its (K, T) buffer. JAX results are these arrays."""
        if self.strides is None:
            return self.shape
        (_, k), (_, t) = self.shape, self.strides
        return (k, t)


def result_specs(
    pattern,
    tokens: int,
    hidden: int,
    dtype_name: str,
    layout=QuantizationSFLayout.SWIZZLED_128x4,
    group_size: Optional[int] = None,
    allreduce_out: bool = False,
) -> Tuple[ResultSpec, ...]:
    """The results ``pattern`` writes for a ``[tokens, hidden]`` input of ``dtype_name``.

    ``layout`` (NVFP4 scale layout) and ``group_size`` (per-token-group FP8) matter only to
    the patterns that use them; both are validated there (quant_layouts). ``allreduce_out``:
    the MoE reduction (pattern 6) also writes the all-reduced combine (FlashInfer's
    ``output=``), after the norm; no other pattern takes it."""
    pattern = as_pattern(pattern)
    traits = TRAITS[pattern]
    rows = (tokens, hidden)  # as given: JAX may trace symbolic dimensions
    if allreduce_out and not traits.optional_allreduce_out:
        raise ValueError(f"{pattern.name} writes no optional all-reduce output")
    if traits.has_allreduce_out:
        return (ResultSpec("allreduce_out", rows, dtype_name),)
    specs = [ResultSpec("residual_out", rows, dtype_name)]
    if traits.has_norm_out:
        specs.append(ResultSpec("norm_out", rows, dtype_name))
    if traits.quant == "fp4":
        specs.append(
            ResultSpec("quant_out", quant_layouts.nvfp4_quant_shape(tokens, hidden), "uint8")
        )
        specs.append(
            ResultSpec(
                "scale_out",
                quant_layouts.nvfp4_scale_shape(tokens, hidden, layout),
                "float8_e4m3fn",
            )
        )
    elif traits.quant is not None:
        specs.append(ResultSpec("quant_out", rows, "float8_e4m3fn"))
        if traits.quant == "dynamic_fp8":
            specs.append(ResultSpec("scale_out", (rows[0], 1), "float32"))
        elif traits.quant == "group_fp8":
            k, t = quant_layouts.group_scale_buffer_shape(tokens, hidden, group_size)
            specs.append(ResultSpec("scale_out", (rows[0], k), "int32", strides=(1, t)))
    if allreduce_out:
        specs.append(ResultSpec("allreduce_out", rows, dtype_name))
    return tuple(specs)


def result_spec(pattern, name: str, *args, **kwargs) -> Optional[ResultSpec]:
    """The spec of result ``name`` of ``pattern`` (arguments as for ``result_specs``), or
    None when the pattern does not write it."""
    for spec in result_specs(pattern, *args, **kwargs):
        if spec.name == name:
            return spec
    return None
