"""The Linen module: ``ResidualRMSNorm`` (see the package docstring)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax.numpy as jnp
from flax import linen as nn

from ..api import allreduce_fusion


class ResidualRMSNorm(nn.Module):
    """All-reduce of ``partial`` over ``axis_name`` + ``residual`` + RMSNorm with the
    module's own gamma, in one fused call: ``residual_out, norm_out = module(partial,
    residual)``.

    Attributes:
      workspace: from ``jax_fusedar.create_allreduce_fusion_workspace`` (its mesh and axis are
        the ``shard_map``'s).
      axis_name: the tensor-parallel axis (default: the workspace's).
      epsilon: RMSNorm's eps.
      weight_bias: 1.0 for Gemma's ``(1 + scale)`` (with ``scale_init=zeros``).
      param_dtype: gamma's dtype; float32 (Flax's default) is rounded to the activations'
        dtype where the kernel reads it, and its gradient flows back through that cast.
      scale_init: gamma's initializer.
      kernel_axes: gamma's logical axis names (``nn.with_logical_partitioning``; MaxText
        names it ``"norm"``), mapped to mesh axes by the caller's logical axis rules.
      use_oneshot, fp32_acc, strict, fallback: passed to ``allreduce_fusion``.
    """

    workspace: Any
    axis_name: Optional[str] = None
    epsilon: float = 1e-6
    weight_bias: float = 0.0
    param_dtype: Any = jnp.float32
    scale_init: Callable = nn.initializers.ones
    kernel_axes: Sequence[Optional[str]] = ("norm",)
    use_oneshot: Optional[bool] = None
    fp32_acc: bool = True
    strict: Optional[bool] = None
    fallback: str = "xla"

    @nn.compact
    def __call__(self, partial, residual):
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(self.scale_init, tuple(self.kernel_axes)),
            (partial.shape[-1],),
            self.param_dtype,
        )
        out = allreduce_fusion(
            partial,
            axis_name=self.axis_name or self.workspace.axis_name,
            workspace=self.workspace,
            residual=residual,
            rms_gamma=scale,
            rms_eps=self.epsilon,
            weight_bias=self.weight_bias,
            use_oneshot=self.use_oneshot,
            fp32_acc=self.fp32_acc,
            strict=self.strict,
            fallback=self.fallback,
        )
        return out.residual_out, out.norm_out
