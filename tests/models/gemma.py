"""A Gemma-style decoder, tensor-parallel in one ``shard_map``: RMSNorm scales by ``(1 + w)``,
and Gemma 2/3's sandwich norms normalize each block's output *before* the residual add
(``sandwich=True``). The fused op normalizes after the add, so that form must stay unfused;
Gemma 1's pre-norm layout (``sandwich=False``) fuses, the ``(1 + w)`` as its weight_bias."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .common import Config, draw, gamma, place_layers, self_attention
from .common import input_sharding  # noqa: F401 (each model's own, as styles.py uses it)

DP, TP = "dp", "tp"
NORMS = ("pre_attention_norm", "post_attention_norm", "pre_ffw_norm", "post_ffw_norm")


@dataclasses.dataclass
class RMSNorm:
    eps: float

    def __call__(self, x, scale):
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(var + self.eps)
        scale = jnp.expand_dims(scale.astype(jnp.float32), axis=range(len(x.shape) - 1))
        return (normed * (1 + scale)).astype(x.dtype)


def init_params(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    d, f, qd = cfg.hidden, cfg.ffn, cfg.heads * cfg.head_dim
    col, row = ((d, qd), d), ((qd, d), qd)
    mlp = dict(w_gate=((d, f), d), w_up=((d, f), d), w_down=((f, d), f))
    layers = [
        {n: gamma(rng, d, dtype, around=0.0) for n in NORMS}
        | draw(rng, dtype, wq=col, wk=col, wv=col, wo=row, **mlp)
        for _ in range(cfg.layers)
    ]
    return dict(layers=layers, final_norm=gamma(rng, d, dtype, around=0.0))


SPECS = {
    **dict.fromkeys(NORMS, P()),
    **dict.fromkeys(["wq", "wk", "wv", "w_gate", "w_up"], P(None, TP)),
    **dict.fromkeys(["wo", "w_down"], P(TP, None)),
}


def place(params, mesh):
    return place_layers(params, mesh, SPECS)


def make_forward(cfg: Config, mesh, sandwich: bool = True):
    norm = RMSNorm(cfg.eps)

    def attention(p, h):
        a = self_attention(h, p["wq"], p["wk"], p["wv"], cfg.head_dim)
        return jax.lax.psum(a @ p["wo"], TP)

    def mlp(p, h):
        gate = jax.nn.gelu(h @ p["w_gate"], approximate=True)
        return jax.lax.psum((gate * (h @ p["w_up"])) @ p["w_down"], TP)

    def body(params, x):
        for p in params["layers"]:
            a = attention(p, norm(x, p["pre_attention_norm"]))
            x = x + (norm(a, p["post_attention_norm"]) if sandwich else a)
            m = mlp(p, norm(x, p["pre_ffw_norm"]))
            x = x + (norm(m, p["post_ffw_norm"]) if sandwich else m)
        return norm(x, params["final_norm"])

    specs = dict(layers=[SPECS] * cfg.layers, final_norm=P())
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DP)), out_specs=P(DP))
