"""The op family's batching rule on the kernel (the "batching" task of jax_multiprocess.py):
``jax.vmap`` and N-D inputs fold the batch into tokens (``jax_fusedar.ops.family.table_batch``),
and the folded call must still be served by the kernel (``strict=True``: a fallback raises)
and be right.

* dense (pattern 1, and 0 for the sum): a vmapped call, the same inputs as one N-D call, and a
  vmapped call with a batched ``rms_gamma`` (one call per element) against the float64
  oracle's bounds on every row of every element (harness.bound_problems);
* MoE reduction (pattern 6): a vmapped call against one call per element, bit for bit: the
  one-shot MoE kernel computes each token's row alone, so the folding must change no bit.

Every rank rebuilds the whole group's inputs and its oracle. On platform "cpu" the bodies run
on the reference path (``fallback="kernel_exact"``), strict off.
"""

import numpy as np

from tests.gpu.workers.common import jax_workspace, jit_shard_map

BATCH, TOKENS, HIDDEN = 3, 5, 1024


def run(jax, jnp, jf, mesh, P, rank, world, seed, *, glob, local, kernel=True):
    from tests.gpu.harness import worst_of
    from tests.gpu.workers.common import plain_ulps
    from tests.oracles import moe_oracle as mo
    from tests.oracles import oracle

    strict = bool(kernel)
    bf16 = jnp.bfloat16
    ws = jax_workspace(jf, mesh, BATCH * TOKENS, HIDDEN, bf16)
    assert ws.backend == ("trtllm" if kernel else "xla"), ws
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((BATCH, TOKENS, HIDDEN)).astype(np.float32) for _ in range(world)]
    xs = [x.astype(bf16) for x in xs]
    res = rng.standard_normal((BATCH, TOKENS, HIDDEN)).astype(np.float32).astype(bf16)
    gam = rng.uniform(-2.0, 2.0, (BATCH, HIDDEN)).astype(np.float32).astype(bf16)

    def fused(x, r, g):
        kw = dict(axis_name="tp", workspace=ws, strict=strict, fallback="kernel_exact")
        o = jf.allreduce_fusion(x, residual=r, rms_gamma=g, **kw)
        a = jf.allreduce_fusion(x, pattern=jf.AllReduceFusionPattern.kAllReduce, **kw)
        return o.residual_out, o.norm_out, a.allreduce_out

    def body(x, r, g):
        x = x[0]
        folded = jax.vmap(fused, in_axes=(0, 0, None))(x, r, g[0])
        nd = fused(x, r, g[0])  # the batch as leading token dims: one call of 15 rows
        mapped = jax.vmap(fused)(x, r, g)  # a batched gamma: one call per element
        return (*folded, *nd, *mapped)

    fn = jit_shard_map(jax, body, mesh, (P("tp"), P(), P()), (P(),) * 9)
    outs = [local(o) for o in fn(glob(P("tp"), xs[rank][None]), glob(P(), res), glob(P(), gam))]
    worst = {"cases": 0}
    for form, (r_out, n_out, a_out) in zip(("vmap", "nd", "map"), (outs[:3], outs[3:6], outs[6:])):
        for b in range(BATCH):
            g = gam[b if form == "map" else 0]
            x64 = [x[b].astype(np.float64) for x in xs]
            r64, g64 = res[b].astype(np.float64), g.astype(np.float64)
            got = dict(residual_out=r_out[b], norm_out=n_out[b], allreduce_out=a_out[b])
            worst_of(worst, plain_ulps(x64, r64, g64, "bfloat16", **got))
            kw = dict(fp32_acc=True, rms_eps=1e-6, weight_bias=0.0, dtype_name="bfloat16")
            worst_of(worst, oracle.accumulation_errors(x64, r64, g64, **got, **kw))
            worst["cases"] += 1
    ws.destroy()
    return {"dense": worst, "moe_mismatches": _moe(jax, jf, mesh, P, rank, world, seed, glob, mo)}


def _moe(jax, jf, mesh, P, rank, world, seed, glob, mo, experts=4, hidden=1024):
    """Pattern 6 vmapped over BATCH elements against one call per element: the count of
    output elements whose bits differ (0 expected)."""
    import jax.numpy as jnp

    ws = jax_workspace(jf, mesh, BATCH * TOKENS, hidden, jnp.bfloat16)
    rng = np.random.default_rng(seed + 1)
    kw = dict(tokens=TOKENS, experts=experts, world=world, dtype_name="bfloat16", hidden=hidden)
    cases = [mo.random_reduction_case(rng, **kw) for _ in range(BATCH)]

    def stack(key):
        return np.stack([c[key][rank] for c in cases])[None]  # [1, BATCH, ...] per rank

    def one(e, s, t, r, g):
        kw = dict(axis_name="tp", workspace=ws, return_allreduce_out=True)
        kw.update(strict=ws.backend == "trtllm", fallback="kernel_exact")
        o = jf.moe_reduction_allreduce_fusion(e, s, t, residual=r, rms_gamma=g, **kw)
        return o.residual_out, o.norm_out, o.allreduce_out

    def body(e, s, t, r, g):
        e, s, t = e[0], s[0], t[0]
        batched = jax.vmap(one, in_axes=(0, 0, 0, 0, None))(e, s, t, r, g)
        single = [one(e[b], s[b], t[b], r[b], g) for b in range(BATCH)]
        return (*batched, *(jnp.stack(o) for o in zip(*single)))

    fn = jit_shard_map(jax, body, mesh, (P("tp"),) * 3 + (P(), P()), (P(),) * 6)
    residual = np.stack([c["residual"] for c in cases])
    args = [glob(P("tp"), stack(k)) for k in ("expert_outputs", "expert_scales", "token_input")]
    outs = fn(*args, glob(P(), residual), glob(P(), cases[0]["gamma"]))
    outs = [np.asarray(o.addressable_data(0)).view(np.uint16) for o in outs]
    ws.destroy()
    return int(sum((a != b).sum() for a, b in zip(outs[:3], outs[3:])))
