"""Llama with one small ``shard_map`` per parallel linear, the way several JAX codebases write
tensor parallelism module by module: a ColumnParallelLinear and a RowParallelLinear each wrap
their matmul in a ``shard_map`` (the row-parallel one ends with ``lax.psum``), and everything
else (RMSNorm, rotary embeddings, attention, the residual adds) is plain ``jnp`` under jit,
which the partitioner lays out. The all-reduce is inside a shard_map; the residual add and
the norm after it are outside."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .common import Config, gamma, normal, place_layers, self_attention
from .common import input_sharding  # noqa: F401 (each model's own, as styles.py uses it)

DP, TP = "dp", "tp"


class ColumnParallelLinear:
    """y = x @ w with w's output features split over the tensor-parallel axis."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, x, w):
        return jax.shard_map(
            lambda x, w: jnp.einsum("btd,df->btf", x, w),
            mesh=self.mesh,
            in_specs=(P(DP), P(None, TP)),
            out_specs=P(DP, None, TP),
        )(x, w)


class RowParallelLinear:
    """y = x @ w with w's input features split: each rank's partial product, all-reduced."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, x, w):
        def local(x, w):
            return jax.lax.psum(jnp.einsum("btf,fd->btd", x, w), TP)

        return jax.shard_map(
            local, mesh=self.mesh, in_specs=(P(DP, None, TP), P(TP, None)), out_specs=P(DP)
        )(x, w)


class RMSNorm:
    def __init__(self, eps):
        self.eps = eps

    def __call__(self, x, weight):
        dtype = x.dtype
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + self.eps)
        return (weight.astype(jnp.float32) * x).astype(dtype)


def init_params(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    d, f, qd = cfg.hidden, cfg.ffn, cfg.heads * cfg.head_dim
    layers = [
        dict(
            attn_norm=gamma(rng, d, dtype),
            wq=normal(rng, (d, qd), d, dtype),
            wk=normal(rng, (d, qd), d, dtype),
            wv=normal(rng, (d, qd), d, dtype),
            wo=normal(rng, (qd, d), qd, dtype),
            mlp_norm=gamma(rng, d, dtype),
            w_gate=normal(rng, (d, f), d, dtype),
            w_up=normal(rng, (d, f), d, dtype),
            w_down=normal(rng, (f, d), f, dtype),
        )
        for _ in range(cfg.layers)
    ]
    return dict(layers=layers, final_norm=gamma(rng, d, dtype))


SPECS = dict(
    attn_norm=P(),
    wq=P(None, TP),
    wk=P(None, TP),
    wv=P(None, TP),
    wo=P(TP, None),
    mlp_norm=P(),
    w_gate=P(None, TP),
    w_up=P(None, TP),
    w_down=P(TP, None),
)


def place(params, mesh):
    return place_layers(params, mesh, SPECS)


def make_forward(cfg: Config, mesh):
    column, row, norm = ColumnParallelLinear(mesh), RowParallelLinear(mesh), RMSNorm(cfg.eps)

    def attention(p, h):
        return row(self_attention(h, p["wq"], p["wk"], p["wv"], cfg.head_dim, column), p["wo"])

    def mlp(p, h):
        return row(jax.nn.silu(column(h, p["w_gate"])) * column(h, p["w_up"]), p["w_down"])

    def forward(params, x):
        for p in params["layers"]:
            x = x + attention(p, norm(x, p["attn_norm"]))
            x = x + mlp(p, norm(x, p["mlp_norm"]))
        return norm(x, params["final_norm"])

    return forward
