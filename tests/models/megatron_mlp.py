"""A residual MLP stack in the Megatron-LM style, ported to JAX: the communication is two
``custom_vjp`` operators, ``f`` (identity forward, all-reduce backward) and ``g`` (all-reduce
forward, identity backward), in a ``shard_map`` without the varying-axes check (as such
ports were written before it existed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .common import Config, draw, gamma, place_layers
from .common import input_sharding  # noqa: F401 (each model's own, as styles.py uses it)

DP, TP = "dp", "tp"


@jax.custom_vjp
def copy_to_tensor_parallel(x):  # Megatron's f
    return x


copy_to_tensor_parallel.defvjp(lambda x: (x, None), lambda _, grad: (jax.lax.psum(grad, TP),))


@jax.custom_vjp
def reduce_from_tensor_parallel(x):  # Megatron's g
    return jax.lax.psum(x, TP)


reduce_from_tensor_parallel.defvjp(
    lambda x: (reduce_from_tensor_parallel(x), None), lambda _, grad: (grad,)
)


def rms_norm(x, weight, eps):
    input_dtype = x.dtype
    x = x.astype(jnp.float32)
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    x = x * jax.lax.rsqrt(variance + eps)
    return (weight.astype(jnp.float32) * x).astype(input_dtype)


def init_params(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    d, f = cfg.hidden, cfg.ffn
    blocks = [draw(rng, dtype, norm=d, w1=((d, f), d), w2=((f, d), f)) for _ in range(cfg.layers)]
    return dict(blocks=blocks, final_norm=gamma(rng, d, dtype))


SPECS = dict(norm=P(), w1=P(None, TP), w2=P(TP, None))


def place(params, mesh):
    return place_layers(params, mesh, SPECS, layers="blocks")


def make_forward(cfg: Config, mesh):
    def block(p, x):
        h = copy_to_tensor_parallel(rms_norm(x, p["norm"], cfg.eps))
        h = jax.nn.gelu(h @ p["w1"])
        return x + reduce_from_tensor_parallel(h @ p["w2"])

    def body(params, x):
        for p in params["blocks"]:
            x = block(p, x)
        return rms_norm(x, params["final_norm"], cfg.eps)

    specs = dict(blocks=[SPECS] * cfg.layers, final_norm=P())
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DP)), out_specs=P(DP), check_vma=False)
