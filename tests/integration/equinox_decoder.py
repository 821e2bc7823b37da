"""An Equinox transformer decoder built from Equinox's own modules (``eqx.nn.Embedding``,
``eqx.nn.RMSNorm``, ``eqx.nn.MultiheadAttention``, ``eqx.nn.Linear``), written the Equinox
way: each module sees one token (or one sequence) and ``jax.vmap`` maps it over the others,
as Equinox's transformer examples do. Tensor-parallel the way Equinox's parallelism example
parallelises: the arrays are placed with shardings (the attention's projections split over
the heads, the MLP's over its width, Megatron's layout) and one jitted computation over
``eqx.partition``'s arrays lets JAX partition it. bfloat16 weights and activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .lane import Built, LaneModel, perturb_norm_weights

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
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(a, NamedSharding(mesh, spec_of(path))), params
    )
    params = perturb_norm_weights(params)
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, VOCAB)

    def forward(params, ids):
        return jax.vmap(eqx.combine(params, static))(ids)

    return Built(forward, params, (ids,), mesh, TP, lambda: jax.set_mesh(mesh), layers)


HOW = (
    "per layer, MultiheadAttention's output_proj and the MLP's down Linear (contracting "
    "the tp-sharded dim) each + residual add + the next eqx.nn.RMSNorm (the MLP's, then "
    "the next block's attention norm or the final norm)"
)

MODELS = [LaneModel("equinox decoder (per-token modules under vmap)", "equinox", 2, HOW, build)]
