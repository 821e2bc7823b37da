"""Per-process body of the handler-error GPU test (two `jax.distributed` processes): the dense
FFI target called directly (``jax.ffi.ffi_call``, bypassing allreduce_fusion's Python checks),
each call's error returned:

* ``wrong_norm_out``: pattern 1 with a norm_out of half the elements: the handler checks every
  result (not only the first), so an INVALID_ARGUMENT naming result 1 (norm_out);
* ``wrong_scale_out``: pattern 11 with a scale_out of the wrong element type;
* ``unknown_algorithm``: algorithm code 7: the core's launch check refuses it
  (INVALID_ARGUMENT), which the handler reported as INTERNAL before;
* ``good``: the same well-formed call one-shot, which runs.

Every refusal happens on both ranks alike before any launch, so nothing waits.
"""

import numpy as np

from tests.gpu.workers.common import jax_workspace

TOKENS, HIDDEN = 16, 1024


def run(jax, jnp, jf, mesh, P, rank, world, seed, glob, local):
    from jax_fusedar.ops.family import register_ffi_targets
    from jax_fusedar.ops.dense import FFI_TARGET

    assert register_ffi_targets()
    bf16 = jnp.bfloat16
    ws = jax_workspace(jf, mesh, TOKENS, HIDDEN, bf16)
    assert ws.backend == "trtllm", ws
    rng = np.random.default_rng(seed + rank)
    x = glob(P("tp"), rng.standard_normal((TOKENS, HIDDEN)).astype(bf16))
    r = glob(P("tp"), rng.standard_normal((TOKENS, HIDDEN)).astype(bf16))
    g = glob(P(), np.ones(HIDDEN, bf16))
    sds = jax.ShapeDtypeStruct

    def call(pattern, results, algorithm=1):
        attrs = dict(workspace_id=np.int64(ws.id), pattern=np.int32(pattern), fp32_acc=True)
        attrs.update(algorithm=np.int32(algorithm), rms_eps=np.float32(1e-6), layout=np.int32(0))
        attrs.update(weight_bias=np.float32(0.0), block_quant_group_size=np.int32(0))

        def body(x, r, g):
            return jax.ffi.ffi_call(FFI_TARGET, results)(x, r, g, **attrs)[0]

        specs = dict(in_specs=(P("tp"), P("tp"), P()), out_specs=P("tp"), check_vma=False)
        f = jax.jit(jax.shard_map(body, mesh=mesh, **specs))
        try:
            jax.block_until_ready(f(x, r, g))
            return "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            return f"{type(e).__name__}: {e}"

    rows = sds((TOKENS, HIDDEN), bf16)
    return {
        "wrong_norm_out": call(1, [rows, sds((TOKENS, HIDDEN // 2), bf16)]),
        "wrong_scale_out": call(
            11, [rows, rows, sds((TOKENS, HIDDEN), jnp.float8_e4m3fn), sds((TOKENS, 1), jnp.int32)]
        ),
        "unknown_algorithm": call(1, [rows, rows], algorithm=7),
        "good": call(1, [rows, rows]),
    }
