"""Llama under plain ``jax.jit`` with sharded weights, no ``shard_map``: the partitioner
inserts the all-reduce after each row-parallel contraction (MaxText's and jax-llm-examples'
way). The o-projection contracts two dimensions (``bhtq,hqd->btd``); on ``AxisType.Explicit``
axes the einsums that contract a sharded dimension name their output sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from .common import Config, draw, gamma, place_layers, rope
from .common import input_sharding  # noqa: F401 (each model's own, as styles.py uses it)

DP, TP = "dp", "tp"


def init_params(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    d, f, h, q = cfg.hidden, cfg.ffn, cfg.heads, cfg.head_dim
    qkv, col = ((d, h, q), d), ((d, f), d)
    shapes = dict(attn_norm=d, wq=qkv, wk=qkv, wv=qkv, wo=((h, q, d), h * q), mlp_norm=d)
    shapes |= dict(w_gate=col, w_up=col, w_down=((f, d), f))
    layers = [draw(rng, dtype, **shapes) for _ in range(cfg.layers)]
    return dict(layers=layers, final_norm=gamma(rng, d, dtype))


SPECS = {
    **dict.fromkeys(["attn_norm", "mlp_norm"], P()),
    **dict.fromkeys(["wq", "wk", "wv"], P(None, TP, None)),
    "wo": P(TP, None, None),
    **dict.fromkeys(["w_gate", "w_up"], P(None, TP)),
    "w_down": P(TP, None),
}


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
        q, k, v = (einsum("btd,dhq->bthq", h, p[w]) for w in ("wq", "wk", "wv"))
        pos = jnp.arange(t)
        q, k = rope(q, pos), rope(k, pos)
        scores = einsum("bthq,bshq->bhts", q.astype(jnp.float32), k.astype(jnp.float32))
        scores = scores / np.sqrt(cfg.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = einsum("bhts,bshq->bhtq", probs, v)  # [b, h, t, q]
        return einsum("bhtq,hqd->btd", out, p["wo"], P(DP))  # two contracted dims

    def mlp(p, h):
        gate, up = (einsum("btd,df->btf", h, p[w]) for w in ("w_gate", "w_up"))
        act = jax.nn.silu(gate) * up
        return einsum("btf,fd->btd", act, p["w_down"], P(DP))

    def forward(params, x):
        for p in params["layers"]:
            x = x + attention(p, rms_norm(x, p["attn_norm"], cfg.eps))
            x = x + mlp(p, rms_norm(x, p["mlp_norm"], cfg.eps))
        return rms_norm(x, params["final_norm"], cfg.eps)

    return forward
