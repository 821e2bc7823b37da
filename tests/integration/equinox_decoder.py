"""An Equinox transformer decoder from Equinox's own modules (``eqx.nn.Embedding``, ``RMSNorm``,
``MultiheadAttention``, ``Linear``), each seeing one token or sequence under ``jax.vmap`` as
Equinox's examples write it; tensor-parallel as its parallelism example is: the arrays placed
with shardings (Megatron's layout), one jitted computation over ``eqx.partition``'s arrays.
bfloat16 weights and activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from .lane import Built, LaneModel, place

LAYERS, VOCAB, D, HEADS, FFN = 2, 512, 256, 8, 512
EPS = 1e-5
TP = "tp"


def _classes():
    import equinox as eqx

    class MLP(eqx.Module):
        gate: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.gate = eqx.nn.Linear(D, FFN, use_bias=False, key=k1)
            self.up = eqx.nn.Linear(D, FFN, use_bias=False, key=k2)
            self.down = eqx.nn.Linear(FFN, D, use_bias=False, key=k3)

        def __call__(self, x):  # one token
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))

    class Block(eqx.Module):
        attn_norm: eqx.nn.RMSNorm
        attn: eqx.nn.MultiheadAttention
        mlp_norm: eqx.nn.RMSNorm
        mlp: MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.attn_norm = eqx.nn.RMSNorm(D, eps=EPS)
            self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
            self.mlp_norm = eqx.nn.RMSNorm(D, eps=EPS)
            self.mlp = MLP(k2)

        def __call__(self, x):  # one sequence [T, D]
            h = jax.vmap(self.attn_norm)(x)
            causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            x = x + self.attn(h, h, h, mask=causal)
            return x + jax.vmap(self.mlp)(jax.vmap(self.mlp_norm)(x))

    class Decoder(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        final_norm: eqx.nn.RMSNorm

        def __init__(self, key, layers):
            keys = jax.random.split(key, layers + 1)
            self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:]]
            self.final_norm = eqx.nn.RMSNorm(D, eps=EPS)

        def __call__(self, ids):  # one sequence of token ids [T]
            x = jax.vmap(self.embed)(ids)
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.final_norm)(x)

    return eqx, Decoder


def spec_of(path) -> P:
    """Megatron's layout over Equinox's (out, in) weights."""
    name = jax.tree_util.keystr(path)
    if any(p in name for p in ("query_proj", "key_proj", "value_proj", ".gate.", ".up.")):
        return P(TP, None)  # split the outputs: the heads, the MLP's width
    if "output_proj" in name or ".down." in name:
        return P(None, TP)  # split the inputs: a partial sum to all-reduce
    return P()


def build(layers: int = LAYERS) -> Built:
    eqx, Decoder = _classes()
    mesh = jax.make_mesh((8,), (TP,), axis_types=(AxisType.Auto,))
    model = Decoder(jax.random.key(0), layers)
    model = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model)
    params, static = eqx.partition(model, eqx.is_array)
    params = place(params, mesh, spec_of)
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, VOCAB)

    def forward(params, ids):
        return jax.vmap(eqx.combine(params, static))(ids)

    return Built(forward, params, (ids,), mesh, TP, layers=layers)


HOW = (
    "per layer, MultiheadAttention's output_proj and the MLP's down Linear (contracting "
    "the tp-sharded dim) each + residual add + the next eqx.nn.RMSNorm (the MLP's, then "
    "the next block's attention norm or the final norm)"
)

MODELS = [LaneModel("equinox decoder (per-token modules under vmap)", "equinox", 2, HOW, build)]
