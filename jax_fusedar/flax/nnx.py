"""The NNX module: ``ResidualRMSNorm`` (see the package docstring)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax.numpy as jnp
from flax import nnx

from ..api import allreduce_fusion


class ResidualRMSNorm(nnx.Module):
    """All-reduce of ``partial`` over ``axis_name`` + ``residual`` + RMSNorm with the
    module's own gamma (``self.scale``, an ``nnx.Param``), in one fused call:
    ``residual_out, norm_out = module(partial, residual)``.

    ``num_features`` is the hidden size. ``kernel_axes`` becomes the parameter's
    ``out_sharding`` metadata (mesh axis names, or logical names mapped by
    ``nnx.logical_axis_rules``); None leaves it without sharding metadata. The other
    arguments are those of the Linen module (``jax_fusedar.flax.ResidualRMSNorm``).
    """

    def __init__(
        self,
        num_features: int,
        *,
        workspace: Any,
        axis_name: Optional[str] = None,
        epsilon: float = 1e-6,
        weight_bias: float = 0.0,
        param_dtype: Any = jnp.float32,
        scale_init: Callable = nnx.initializers.ones,
        kernel_axes: Optional[Sequence[Optional[str]]] = None,
        use_oneshot: Optional[bool] = None,
        fp32_acc: bool = True,
        strict: Optional[bool] = None,
        fallback: str = "xla",
        rngs: nnx.Rngs,
    ):
        metadata = {} if kernel_axes is None else {"out_sharding": tuple(kernel_axes)}
        self.scale = nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype), **metadata)
        # Static attributes (no arrays): they go into the graph definition, not the state.
        self.workspace = nnx.static(workspace)
        self.axis_name = axis_name or workspace.axis_name
        self.epsilon = epsilon
        self.weight_bias = weight_bias
        self.use_oneshot = use_oneshot
        self.fp32_acc = fp32_acc
        self.strict = strict
        self.fallback = fallback

    def __call__(self, partial, residual):
        out = allreduce_fusion(
            partial,
            axis_name=self.axis_name,
            workspace=self.workspace,
            residual=residual,
            rms_gamma=self.scale[...],
            rms_eps=self.epsilon,
            weight_bias=self.weight_bias,
            use_oneshot=self.use_oneshot,
            fp32_acc=self.fp32_acc,
            strict=self.strict,
            fallback=self.fallback,
        )
        return out.residual_out, out.norm_out
