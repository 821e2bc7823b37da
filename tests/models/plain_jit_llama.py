"""Llama under plain ``jax.jit`` with shardings, no ``shard_map``: the weights carry
``NamedSharding``s (heads and FFN features over the tensor-parallel axis) and the
partitioner inserts the all-reduce after each row-parallel contraction, MaxText's and
jax-llm-examples' way. Projections are einsums; the attention output stays [batch, heads,
time, head_dim] and the o-projection contracts two dimensions (``bhtq,hqd->btd``). With
``AxisType.Explicit`` axes the shardings are part of the types, and the einsums that
contract a sharded dimension name their output sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from .common import Config, gamma, normal, place_layers, rope
from .common import input_sharding  # noqa: F401 (each model's own, as styles.py uses it)

DP, TP = "dp", "tp"


def init_params(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    d, f, h, q = cfg.hidden, cfg.ffn, cfg.heads, cfg.head_dim
    layers = [
        dict(
            attn_norm=gamma(rng, d, dtype),
            wq=normal(rng, (d, h, q), d, dtype),
            wk=normal(rng, (d, h, q), d, dtype),
            wv=normal(rng, (d, h, q), d, dtype),
            wo=normal(rng, (h, q, d), h * q, dtype),
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
    wq=P(None, TP, None),
    wk=P(None, TP, None),
    wv=P(None, TP, None),
    wo=P(TP, None, None),
    mlp_norm=P(),
    w_gate=P(None, TP),
    w_up=P(None, TP),
    w_down=P(TP, None),
)


def place(params, mesh):
    return place_layers(params, mesh, SPECS)


def rms_norm(x, gamma, eps):
    rms = jnp.sqrt(jnp.mean(jnp.astype(x, jnp.float32) ** 2, axis=-1, keepdims=True) + eps)
    return jnp.astype(gamma.astype(jnp.float32) * x.astype(jnp.float32) / rms, x.dtype)


def make_forward(cfg: Config, mesh):
    explicit = AxisType.Explicit in set(mesh.axis_types)

    def einsum(spec, a, b, out=None):
        if explicit and out is not None:
            return jnp.einsum(spec, a, b, out_sharding=out)
        return jnp.einsum(spec, a, b)

    def attention(p, h):
        t = h.shape[1]
        q = einsum("btd,dhq->bthq", h, p["wq"])
        k = einsum("btd,dhq->bthq", h, p["wk"])
        v = einsum("btd,dhq->bthq", h, p["wv"])
        pos = jnp.arange(t)
        q, k = rope(q, pos), rope(k, pos)
        scores = einsum("bthq,bshq->bhts", q.astype(jnp.float32), k.astype(jnp.float32))
        scores = scores / np.sqrt(cfg.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = einsum("bhts,bshq->bhtq", probs, v)  # [b, h, t, q]
        return einsum("bhtq,hqd->btd", out, p["wo"], P(DP))  # two contracted dims

    def mlp(p, h):
        act = jax.nn.silu(einsum("btd,df->btf", h, p["w_gate"])) * einsum(
            "btd,df->btf", h, p["w_up"]
        )
        return einsum("btf,fd->btd", act, p["w_down"], P(DP))

    def forward(params, x):
        for p in params["layers"]:
            x = x + attention(p, rms_norm(x, p["attn_norm"], cfg.eps))
            x = x + mlp(p, rms_norm(x, p["mlp_norm"], cfg.eps))
        return rms_norm(x, params["final_norm"], cfg.eps)

    return forward
