"""The 4-layer tensor-parallel model of the plain-jit tests, written twice: MaxText's way
(global arrays, NamedSharding on the weights, ``row_parallel_allreduce_fusion``, no
shard_map) and per shard (shard_map + ``allreduce_fusion``). Shared by
tests/jax/test_jit_sharding.py and the GPU worker tests/gpu/workers/jax_single_process.py; sets no
environment, so it imports under any platform."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf

LAYERS, BATCH, SEQ, HIDDEN, FFN = 4, 4, 8, 256, 512
PARAM_SPECS = dict(w1=P(None, "tp"), w2=P("tp", None), gamma=P())
ACT_SPEC = P("dp", None, None)


def model_params(rng, dtype=jnp.bfloat16, hidden=HIDDEN, ffn=FFN):
    """Per layer: column-parallel up projection, row-parallel down projection, norm gamma;
    scaled so that activations stay O(1) through the layers. Fresh values from ``rng``."""

    def normal(shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)

    return [
        dict(
            w1=normal((hidden, ffn), 1 / 16),
            w2=normal((ffn, hidden), 1 / 16),
            gamma=rng.uniform(-2, 2, hidden).astype(np.float32).astype(dtype),
        )
        for _ in range(LAYERS)
    ]


def jit_model(params, x, *, workspace):
    """MaxText style: global arrays, shardings only on the inputs, no shard_map."""
    h, residual = x, x
    for p in params:
        a = jax.nn.gelu(jnp.dot(h, p["w1"]))
        out = jf.row_parallel_allreduce_fusion(
            a, p["w2"], residual=residual, rms_gamma=p["gamma"], workspace=workspace
        )
        h, residual = out.norm_out, out.residual_out
    return h, residual


def shard_map_model(mesh, ws):
    """The same model written per shard with allreduce_fusion."""

    def body(params, x):
        h, residual = x, x
        for p in params:
            a = jax.nn.gelu(jnp.dot(h, p["w1"]))
            partial = jnp.dot(a, p["w2"])
            shape = partial.shape
            out = jf.allreduce_fusion(
                partial.reshape(-1, shape[-1]),
                axis_name="tp",
                workspace=ws,
                residual=residual.reshape(-1, shape[-1]),
                rms_gamma=p["gamma"],
            )
            h, residual = out.norm_out.reshape(shape), out.residual_out.reshape(shape)
        return h, residual

    specs = [PARAM_SPECS] * LAYERS
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, ACT_SPEC), out_specs=(ACT_SPEC, ACT_SPEC))
    )


def place(mesh, params, x):
    params = [
        {k: jax.device_put(v, NamedSharding(mesh, PARAM_SPECS[k])) for k, v in p.items()}
        for p in params
    ]
    return params, jax.device_put(x, NamedSharding(mesh, ACT_SPEC))
