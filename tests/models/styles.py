"""The style models with what ``jax_fusedar.fuse`` must make of each: the sites it finds, how
many it fuses, the reason for the others, and how the model is laid out on a mesh of
("dp", "tp") axes. Used by the CPU tests (tests/jax/test_fuse_styles.py) and the GPU test
(tests/gpu/fuse_styles.py); sets no environment, so it imports under any platform."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from . import annotated_llama, gemma, hf_flax_llama, megatron_mlp, per_linear_llama
from . import plain_jit_llama, scanned_llama, sequence_parallel_llama
from .common import Config, activations

PSUM_IN_SHARD_MAP = "shard_map psum"
REDUCE_SCATTER = "reduce_scatter"
CUSTOM_RULE_PSUM = "custom_vjp psum"
PLAIN_JIT = "dot_general"
PSUM = "psum"


@dataclasses.dataclass(frozen=True)
class Style:
    name: str
    module: object
    sites_per_layer: int  # sites fuse finds per layer
    fused: bool  # whether they are fused (all of them) or all refused
    kind: str
    reason: Optional[str] = None  # the refusal's start, when not fused
    forward_kwargs: tuple = ()  # make_forward's keyword arguments
    dtype: str = "bfloat16"
    weight_dtype: Optional[str] = None  # norm weights' dtype, when not the model's
    axis_type: AxisType = AxisType.Auto
    allow_rounding_change: bool = False
    rounding_change: bool = False  # fused sites report a rounding change
    weight_bias: float = 0.0
    # The CPU test also compares gradients (one style per machinery suffices: each costs
    # two more compilations).
    grad_check: bool = True

    def sites(self, cfg: Config) -> int:
        return self.sites_per_layer * cfg.layers

    def mesh(self, shape=(2, 4)):
        return jax.make_mesh(shape, ("dp", "tp"), axis_types=(self.axis_type,) * 2)

    def params(self, cfg: Config, seed: int, dtype=None):
        dtype = jnp.dtype(dtype or self.dtype)
        if self.weight_dtype is not None:
            return self.module.init_params(cfg, seed, dtype, jnp.dtype(self.weight_dtype))
        return self.module.init_params(cfg, seed, dtype)

    def forward(self, cfg: Config, mesh):
        kwargs = dict(self.forward_kwargs)
        if self.module is hf_flax_llama:
            kwargs["dtype"] = jnp.dtype(self.dtype)
        return self.module.make_forward(cfg, mesh, **kwargs)

    def inputs(self, cfg: Config, mesh, seed: int, dtype=None):
        """(placed params, placed activations)."""
        dtype = dtype or self.dtype
        x = activations(cfg, seed + 1, jnp.dtype(dtype))
        placed = self.module.place(self.params(cfg, seed, dtype), mesh)
        return placed, jax.device_put(x, self.module.input_sharding(mesh))


RM = (("remat", False),)  # annotated_llama without jax.checkpoint
PT = (*RM, ("per_token", True))  # ... and Equinox's per-token Linear
BIAS = (*PT, ("bias", True))  # ... and Equinox's RMSNorm bias
STYLES = [
    Style("per_linear_llama", per_linear_llama, 2, True, PSUM_IN_SHARD_MAP),
    Style("sequence_parallel_llama", sequence_parallel_llama, 2, True, REDUCE_SCATTER),
    Style(
        "sequence_parallel_llama_norm_after_gather",
        sequence_parallel_llama,
        2,
        True,
        REDUCE_SCATTER,
        forward_kwargs=(("norm_after_gather", True),),
        grad_check=False,
    ),
    Style("megatron_mlp", megatron_mlp, 1, True, CUSTOM_RULE_PSUM),
    Style("plain_jit_llama_auto", plain_jit_llama, 2, True, PLAIN_JIT),
    Style(
        "plain_jit_llama_explicit", plain_jit_llama, 2, True, PLAIN_JIT, axis_type=AxisType.Explicit
    ),
    Style("gemma_sandwich", gemma, 2, False, PSUM, reason="sandwich norm"),
    Style(
        "gemma_pre_norm",
        gemma,
        2,
        True,
        PSUM,
        forward_kwargs=(("sandwich", False),),
        weight_bias=1.0,
        grad_check=False,
    ),
    # gamma multiplied after the normalized value's rounding: the fused op computes that
    # rounded value (a gamma of ones) and the program's own multiplication stays after it.
    Style("hf_flax_llama", hf_flax_llama, 2, True, PSUM),
    Style("hf_flax_llama_allow", hf_flax_llama, 2, True, PSUM, allow_rounding_change=True),
    Style("hf_flax_llama_f32_weights", hf_flax_llama, 2, True, PSUM, weight_dtype="float32"),
    # Sharding constraints and checkpoint names between the matmul, the add and the norm.
    Style("annotated_llama", annotated_llama, 2, True, PLAIN_JIT, forward_kwargs=RM),
    # Equinox's per-token Linear under vmap: w @ x, then a transpose.
    Style(
        "annotated_llama_per_token",
        annotated_llama,
        2,
        True,
        PLAIN_JIT,
        forward_kwargs=PT,
        grad_check=False,
    ),
    # Equinox's RMSNorm with its bias: refused by default, fused with the flag.
    Style(
        "annotated_llama_bias",
        annotated_llama,
        2,
        False,
        PLAIN_JIT,
        forward_kwargs=BIAS,
        reason="a bias added to the normalized value before its rounding to bfloat16",
    ),
    Style(
        "annotated_llama_bias_allow",
        annotated_llama,
        2,
        True,
        PLAIN_JIT,
        forward_kwargs=BIAS,
        allow_rounding_change=True,
        rounding_change=True,
    ),
    # MaxText's RMSNorm: gamma in T by an einsum after the rounding (left after the fused norm).
    Style(
        "annotated_llama_gamma_einsum",
        annotated_llama,
        2,
        True,
        PLAIN_JIT,
        forward_kwargs=(*RM, ("gamma_einsum", True)),
        grad_check=False,
    ),
    # Scanned over the layers: the add of layer i and the norm of layer i + 1 in two
    # iterations (the loop is rotated). The body's 2 sites are the program's sites, each
    # running once per layer (sites_per_layer * layers = 2 with 2 layers).
    Style("scanned_llama_plain_jit", scanned_llama, 1, True, PLAIN_JIT),
    Style(
        "scanned_llama_shard_map",
        scanned_llama,
        1,
        True,
        PSUM,
        forward_kwargs=(("layout", "shard_map"),),
    ),
    Style("hf_flax_llama_float32", hf_flax_llama, 2, True, PSUM, dtype="float32", grad_check=False),
]

BY_NAME = {s.name: s for s in STYLES}
