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
    cast = lambda a: a.astype(np.float32).astype(dtype)
    normal = lambda shape: cast(rng.standard_normal(shape) / 16)
    layer = lambda: dict(
        w1=normal((hidden, ffn)), w2=normal((ffn, hidden)), gamma=cast(rng.uniform(-2, 2, hidden))
    )
    return [layer() for _ in range(LAYERS)]


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
            partial = jnp.dot(jax.nn.gelu(jnp.dot(h, p["w1"])), p["w2"])
            shape, flat = partial.shape, lambda a: a.reshape(-1, partial.shape[-1])
            out = jf.allreduce_fusion(
                flat(partial),
                axis_name="tp",
                workspace=ws,
                residual=flat(residual),
                rms_gamma=p["gamma"],
            )
            h, residual = out.norm_out.reshape(shape), out.residual_out.reshape(shape)
        return h, residual

    specs = ([PARAM_SPECS] * LAYERS, ACT_SPEC)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(ACT_SPEC, ACT_SPEC)))


def place(mesh, params, x):
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
    return [{k: put(v, PARAM_SPECS[k]) for k, v in p.items()} for p in params], put(x, ACT_SPEC)
