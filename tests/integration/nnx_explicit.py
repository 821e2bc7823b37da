"""A Flax NNX decoder written as Flax's NNX sharding guide writes its explicit-sharding model:
an Explicit-axes mesh ``("data", "model")``, parameters created sharded, ``out_sharding=``
where a matmul's is ambiguous, layers made by ``jax.vmap`` and run by ``jax.lax.scan``, the
model passed to ``jax.jit``; ``nnx.RMSNorm``, a Llama-style pre-norm block, bfloat16."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .lane import Built, LaneModel, perturb_norm_weights

LAYERS, D, HEADS, HEAD_DIM, FFN = 2, 256, 8, 32, 512
EPS = 1e-5
DT = jnp.bfloat16


def _classes():
    from flax import nnx

    init = nnx.initializers.lecun_normal()

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            p = lambda shape, spec: nnx.Param(  # noqa: E731
                init(rngs.params(), shape, DT, out_sharding=spec)
            )
            self.wq = p((D, HEADS, HEAD_DIM), P(None, "model", None))
            self.wk = p((D, HEADS, HEAD_DIM), P(None, "model", None))
            self.wv = p((D, HEADS, HEAD_DIM), P(None, "model", None))
            self.wo = p((HEADS, HEAD_DIM, D), P("model", None, None))
            self.w_gate = p((D, FFN), P(None, "model"))
            self.w_up = p((D, FFN), P(None, "model"))
            self.w_down = p((FFN, D), P("model", None))
            self.attn_norm = nnx.RMSNorm(D, epsilon=EPS, dtype=DT, rngs=rngs)
            self.mlp_norm = nnx.RMSNorm(D, epsilon=EPS, dtype=DT, rngs=rngs)

        def attention(self, x):
            heads = P("data", None, "model", None)
            q = jnp.einsum("btd,dhk->bthk", x, self.wq[...], out_sharding=heads)
            k = jnp.einsum("btd,dhk->bthk", x, self.wk[...], out_sharding=heads)
            v = jnp.einsum("btd,dhk->bthk", x, self.wv[...], out_sharding=heads)
            logits = jnp.einsum("bthk,bshk->bhts", q, k) / jnp.sqrt(HEAD_DIM).astype(DT)
            t = x.shape[1]
            causal = jnp.tril(jnp.ones((t, t), bool))
            weights = jax.nn.softmax(jnp.where(causal, logits, -1e9).astype(jnp.float32), -1)
            ctx = jnp.einsum("bhts,bshk->bthk", weights.astype(DT), v)
            return jnp.einsum(
                "bthk,hkd->btd", ctx, self.wo[...], out_sharding=P("data", None, None)
            )

        def mlp(self, x):
            wide = P("data", None, "model")
            h = jax.nn.silu(jnp.dot(x, self.w_gate[...], out_sharding=wide)) * jnp.dot(
                x, self.w_up[...], out_sharding=wide
            )
            return jnp.dot(h, self.w_down[...], out_sharding=P("data", None, None))

        def __call__(self, x):
            x = x + self.attention(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))

    class Decoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, scan: bool, layers: int):
            self.scan, self.n_layers = scan, layers

            @partial(jax.vmap, spmd_axis_name=None)
            def create_layers(r):
                return Block(r)

            self.layers = create_layers(rngs.fork(split=layers))
            self.final_norm = nnx.RMSNorm(D, epsilon=EPS, dtype=DT, rngs=rngs)

        def __call__(self, x):
            if self.scan:
                x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
            else:
                for i in range(self.n_layers):
                    x = jax.tree.map(lambda a: a[i], self.layers)(x)
            return self.final_norm(x)

    return Decoder


def build(scan: bool, layers: int = LAYERS) -> Built:
    from flax import nnx

    mesh = jax.make_mesh((1, 8), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    Decoder = _classes()
    with jax.set_mesh(mesh):
        model = perturb_norm_weights(Decoder(nnx.Rngs(0), scan, layers))
        x = jax.device_put(
            jax.random.normal(jax.random.key(1), (2, 16, D), DT),
            NamedSharding(mesh, P("data", None, None)),
        )

    def forward(model, x):
        return model(x)

    return Built(forward, model, (x,), mesh, "model", layers=layers)


HOW = (
    "per layer, the attention's out-projection (einsum over the model-sharded heads) and the "
    "MLP's down-projection (dot contracting the model-sharded width) each + residual add + "
    "the next nnx.RMSNorm (the MLP's norm, then the next layer's attention norm or the "
    "final norm)"
)

MODELS = [
    LaneModel("flax nnx decoder, Explicit axes, lax.scan", "flax", 2, HOW, partial(build, True)),
    LaneModel("flax nnx decoder, Explicit axes, unrolled", "flax", 2, HOW, partial(build, False)),
]
