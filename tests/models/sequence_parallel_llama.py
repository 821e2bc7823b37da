"""Llama with Megatron-style sequence parallelism in one ``shard_map``: the residual stream is
split along the sequence over the tensor-parallel axis; each row-parallel projection ends
with ``lax.psum_scatter``, the residual is added on the token shard, and the shard's norm is
gathered (``lax.all_gather``) for the next projection. ``norm_after_gather=True`` gathers
first and normalizes every token (the other order the same algebra allows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from . import per_linear_llama
from .common import Config, self_attention

DP, TP = "dp", "tp"
init_params = per_linear_llama.init_params
SPECS = per_linear_llama.SPECS
place = per_linear_llama.place
ACT = P(DP, TP)  # [batch, seq, hidden]: the sequence split over TP


def input_sharding(mesh):
    return NamedSharding(mesh, ACT)


def rms_norm(x, weight, eps):
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + eps)
    return (h * weight.astype(jnp.float32)).astype(x.dtype)


def make_forward(cfg: Config, mesh, norm_after_gather: bool = False):
    def gather(x):
        return jax.lax.all_gather(x, TP, axis=1, tiled=True)

    def scatter(x):
        return jax.lax.psum_scatter(x, TP, scatter_dimension=1, tiled=True)

    def normed(x_local, weight):
        """The norm's output on every token, for a column-parallel projection."""
        if norm_after_gather:
            return rms_norm(gather(x_local), weight, cfg.eps)
        return gather(rms_norm(x_local, weight, cfg.eps))

    def attention(p, h):
        return scatter(self_attention(h, p["wq"], p["wk"], p["wv"], cfg.head_dim) @ p["wo"])

    def mlp(p, h):
        return scatter((jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"])

    def body(params, x):
        for p in params["layers"]:
            x = x + attention(p, normed(x, p["attn_norm"]))
            x = x + mlp(p, normed(x, p["mlp_norm"]))
        return normed(x, params["final_norm"])

    specs = dict(layers=[SPECS] * cfg.layers, final_norm=P())
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, ACT), out_specs=P(DP), check_vma=False)
