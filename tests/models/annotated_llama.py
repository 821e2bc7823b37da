"""Llama under plain ``jax.jit`` with the value-preserving annotations framework code puts
between the matmul, the residual add and the norm (MaxText's way): sharding constraints,
``checkpoint_name``s, each layer under ``jax.checkpoint``. ``per_token=True``: Equinox's
per-token ``Linear`` with an (out, in) weight under ``jax.vmap`` (``w @ x``, then a
transpose). ``gamma_einsum=True``: MaxText's RMSNorm (the value rounded, then an einsum with
gamma in that dtype, left after the fused norm). ``bias=True``: Equinox's RMSNorm bias,
added before the rounding (fused only with ``allow_rounding_change``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from .common import Config, draw, gamma, place_layers
from .common import input_sharding  # noqa: F401 (each model's own, as styles.py uses it)

DP, TP = "dp", "tp"


def init_params(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    d, f = cfg.hidden, cfg.ffn
    shapes = dict(attn_norm=d, wv=((d, d), d), wo=((d, d), d), mlp_norm=d, w_up=((d, f), d))
    bias = lambda: gamma(rng, d, dtype, around=0.0)
    layers = [
        draw(rng, dtype, **shapes, w_down=((f, d), f)) | dict(attn_bias=bias(), mlp_bias=bias())
        for _ in range(cfg.layers)
    ]
    return dict(layers=layers, final_norm=gamma(rng, d, dtype), final_bias=bias())


SPECS = {
    **dict.fromkeys(["attn_norm", "mlp_norm", "attn_bias", "mlp_bias"], P()),
    **dict.fromkeys(["wv", "w_up"], P(None, TP)),
    **dict.fromkeys(["wo", "w_down"], P(TP, None)),
}


def place(params, mesh):
    return place_layers(params, mesh, SPECS)


def make_forward(cfg: Config, mesh, per_token=False, gamma_einsum=False, remat=True, bias=False):
    def constrain(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def rms_norm(x, g, b):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + cfg.eps)
        if gamma_einsum:  # MaxText: rounded, then gamma in the activation dtype
            return jnp.einsum("k,...k->...k", g.astype(x.dtype), y.astype(x.dtype))
        y = y * g.astype(jnp.float32)
        if bias:  # Equinox's RMSNorm(use_bias=True): added in float32 before the rounding
            y = y + b.astype(jnp.float32)
        return y.astype(x.dtype)

    def linear(x, w):
        if per_token:  # Equinox: an (out, in) weight, one token at a time under vmap
            one = lambda t: w.T @ t  # noqa: E731
            return jax.vmap(jax.vmap(one))(x)
        return x @ w

    def layer(p, x):
        x = checkpoint_name(constrain(x, P(DP)), "decoder_layer_input")
        h = constrain(rms_norm(x, p["attn_norm"], p["attn_bias"]), P(DP))
        v = checkpoint_name(linear(h, p["wv"]), "value_proj")
        o = constrain(checkpoint_name(linear(v, p["wo"]), "out_proj"), P(DP))
        x = x + o
        h = rms_norm(x, p["mlp_norm"], p["mlp_bias"])
        u = jax.nn.silu(checkpoint_name(linear(h, p["w_up"]), "mlpwi"))
        d = constrain(checkpoint_name(linear(u, p["w_down"]), "mlpwo"), P(DP))
        return constrain(x + d, P(DP))

    step = jax.checkpoint(layer) if remat else layer

    def forward(params, x):
        for p in params["layers"]:
            x = step(p, x)
        return rms_norm(x, params["final_norm"], params["final_bias"])

    return forward
