"""Llama with one small ``shard_map`` per parallel linear, as several JAX codebases write
tensor parallelism module by module (the row-parallel one ends with ``lax.psum``); the rest,
residual adds and norms included, is plain ``jnp`` under jit: the all-reduce is inside a
shard_map, the add and the norm after it outside."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .common import Config, gamma, llama_layers, place_layers, self_attention
from .common import input_sharding  # noqa: F401 (each model's own, as styles.py uses it)

DP, TP = "dp", "tp"


@dataclasses.dataclass
class ColumnParallelLinear:
    """y = x @ w with w's output features split over the tensor-parallel axis."""

    mesh: object

    def __call__(self, x, w):
        local = lambda x, w: jnp.einsum("btd,df->btf", x, w)
        specs = dict(in_specs=(P(DP), P(None, TP)), out_specs=P(DP, None, TP))
        return jax.shard_map(local, mesh=self.mesh, **specs)(x, w)


@dataclasses.dataclass
class RowParallelLinear:
    """y = x @ w with w's input features split: each rank's partial product, all-reduced."""

    mesh: object

    def __call__(self, x, w):
        local = lambda x, w: jax.lax.psum(jnp.einsum("btf,fd->btd", x, w), TP)
        specs = dict(in_specs=(P(DP, None, TP), P(TP, None)), out_specs=P(DP))
        return jax.shard_map(local, mesh=self.mesh, **specs)(x, w)


@dataclasses.dataclass
class RMSNorm:
    eps: float

    def __call__(self, x, weight):
        dtype = x.dtype
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + self.eps)
        return (weight.astype(jnp.float32) * x).astype(dtype)


def init_params(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    names = "attn_norm wq wk wv wo mlp_norm w_gate w_up w_down".split()
    layers = llama_layers(cfg, rng, dtype, names)
    return dict(layers=layers, final_norm=gamma(rng, cfg.hidden, dtype))


SPECS = {
    **dict.fromkeys(["attn_norm", "mlp_norm"], P()),
    **dict.fromkeys(["wq", "wk", "wv", "w_gate", "w_up"], P(None, TP)),
    **dict.fromkeys(["wo", "w_down"], P(TP, None)),
}


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
