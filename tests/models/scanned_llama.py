"""A pre-norm Llama decoder scanned over its stacked layers (``jax.lax.scan``, as ``nn.scan``
/ ``nnx.scan`` models and MaxText's ``scan_layers`` run): the add of layer i and the norm of
layer i + 1 are in different iterations. ``layout``: ``"plain_jit"`` (the partitioner's
all-reduce) or ``"shard_map"`` (``psum`` after each row-parallel matmul); ``final_norm=False``
returns the loop's result; ``remat=True`` checkpoints each layer, as MaxText's
``scan_layers`` and Flax's ``nn.scan(nn.remat(...))`` do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .common import Config, gamma, normal
from .common import input_sharding  # noqa: F401 (each model's own, as styles.py uses it)

DP, TP = "dp", "tp"


def init_params(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    d, f, L = cfg.hidden, cfg.ffn, cfg.layers
    return dict(
        attn_norm=np.stack([gamma(rng, d, dtype) for _ in range(L)]),
        wv=normal(rng, (L, d, d), d, dtype),
        wo=normal(rng, (L, d, d), d, dtype),
        mlp_norm=np.stack([gamma(rng, d, dtype) for _ in range(L)]),
        w_up=normal(rng, (L, d, f), d, dtype),
        w_down=normal(rng, (L, f, d), f, dtype),
        final_norm=gamma(rng, d, dtype),
    )


SPECS = {
    **dict.fromkeys(["attn_norm", "mlp_norm", "final_norm"], P()),
    **dict.fromkeys(["wv", "w_up"], P(None, None, TP)),
    **dict.fromkeys(["wo", "w_down"], P(None, TP, None)),
}


def place(params, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}


def make_forward(cfg: Config, mesh, layout="plain_jit", final_norm=True, remat=False):
    def rms_norm(x, g):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + cfg.eps)
        return (y * g.astype(jnp.float32)).astype(x.dtype)

    reduce = (lambda v: jax.lax.psum(v, TP)) if layout == "shard_map" else (lambda v: v)

    def layer(x, p):
        h = rms_norm(x, p["attn_norm"])
        x = x + reduce(jnp.tanh(h @ p["wv"]) @ p["wo"])
        h = rms_norm(x, p["mlp_norm"])
        return x + reduce(jax.nn.silu(h @ p["w_up"]) @ p["w_down"]), None

    def decoder(params, x):
        stacked = {k: v for k, v in params.items() if k != "final_norm"}
        x, _ = jax.lax.scan(jax.checkpoint(layer) if remat else layer, x, stacked)
        return rms_norm(x, params["final_norm"]) if final_norm else x

    if layout == "plain_jit":
        return decoder
    return jax.shard_map(
        decoder, mesh=mesh, in_specs=(dict(SPECS), P(DP)), out_specs=P(DP), check_vma=False
    )
