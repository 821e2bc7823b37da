"""``ResidualRMSNorm`` for Equinox (see the package docstring)."""

from __future__ import annotations

from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from ..api import allreduce_fusion


class ResidualRMSNorm(eqx.Module):
    """All-reduce of ``partial`` over ``axis_name`` + ``residual`` + RMSNorm with the
    module's own ``weight`` (gamma), in one fused call: ``residual_out, norm_out =
    module(partial, residual)``.

    Named as ``equinox.nn.RMSNorm`` names them: ``shape`` (the hidden size), ``eps``,
    ``weight`` (ones of ``dtype``, float32 by default: then rounded to the activations' dtype
    where the kernel reads it, its gradient flowing back through that cast). ``workspace``
    comes from ``jax_fusedar.create_allreduce_fusion_workspace``; ``axis_name`` defaults to
    its axis; ``weight_bias=1.0`` is Gemma's ``(1 + weight)``; ``use_oneshot``, ``fp32_acc``,
    ``strict`` and ``fallback`` are passed to ``allreduce_fusion``.
    """

    weight: jax.Array
    shape: int = eqx.field(static=True)
    workspace: Any = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    weight_bias: float = eqx.field(static=True)
    use_oneshot: Optional[bool] = eqx.field(static=True)
    fp32_acc: bool = eqx.field(static=True)
    strict: Optional[bool] = eqx.field(static=True)
    fallback: str = eqx.field(static=True)

    def __init__(
        self,
        shape: int,
        *,
        workspace: Any,
        axis_name: Optional[str] = None,
        eps: float = 1e-6,
        weight_bias: float = 0.0,
        dtype: Any = None,
        use_oneshot: Optional[bool] = None,
        fp32_acc: bool = True,
        strict: Optional[bool] = None,
        fallback: str = "xla",
    ):
        self.shape = int(shape)
        self.weight = jnp.ones((self.shape,), jnp.float32 if dtype is None else dtype)
        self.workspace = workspace
        self.axis_name = axis_name or workspace.axis_name
        self.eps = eps
        self.weight_bias = weight_bias
        self.use_oneshot = use_oneshot
        self.fp32_acc = fp32_acc
        self.strict = strict
        self.fallback = fallback

    def __call__(self, partial, residual, *, key=None):
        """``key`` is ignored (Equinox's layer convention)."""
        del key
        out = allreduce_fusion(
            partial,
            axis_name=self.axis_name,
            workspace=self.workspace,
            residual=residual,
            rms_gamma=self.weight,
            rms_eps=self.eps,
            weight_bias=self.weight_bias,
            use_oneshot=self.use_oneshot,
            fp32_acc=self.fp32_acc,
            strict=self.strict,
            fallback=self.fallback,
        )
        return out.residual_out, out.norm_out
