"""Gradients of a TP MLP with the fused op (the kernel on GPUs) against the same model unfused
(psum + residual add + RMSNorm, jax_fusedar.ops.reference) and a float64 numpy oracle with
hand-written backpropagation. Inputs are placed with make_array_from_callback from arrays
every process draws from one seed and results gathered with process_allgather, so the same
code runs as two `jax.distributed` GPU processes (tests/gpu/test_jax.py) and in one process
on 2 CPU devices (tests/jax/test_quant_worker_plumbing.py: there the fused op is the
reference and the two models must agree bit for bit).

The model: L layers of y -> tanh(y @ W1) @ W2 (W1 column-, W2 row-parallel over "tp"), then
(residual, y) = allreduce_fusion(partial, residual, gamma); loss = sum(y_L * ct), so the
gradient is one VJP. Errors per gradient tensor are in ulps of the dtype at the tensor's
largest float64 magnitude ("ulps of scale": matmul gradients have no meaningful per-element
ulp where they cancel), and normwise relative.
"""

import numpy as np

from tests.gpu.workers.common import jax_workspace

EPS = 1e-6
ULP1 = {"bfloat16": 2.0**-7, "float32": 2.0**-23}  # ulp of 1.0
NAMES = ("w1", "w2", "gamma", "x")


def draw(seed, dtype, layers, tokens, hidden, ffn):
    """(w1 [L,H,F], w2 [L,F,H], gamma [L,H], x [T,H], ct [T,H]) rounded to dtype."""
    import ml_dtypes  # noqa: F401 (jax's dependency: numpy knows bfloat16)

    rng = np.random.default_rng(seed)
    t = np.dtype(dtype)
    w1 = (rng.standard_normal((layers, hidden, ffn)) / np.sqrt(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((layers, ffn, hidden)) / np.sqrt(ffn)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, (layers, hidden)).astype(np.float32)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ct = rng.standard_normal((tokens, hidden)).astype(np.float32)
    return tuple(a.astype(t) for a in (w1, w2, gamma, x, ct))


def oracle_grads(w1, w2, gamma, x, ct):
    """float64 forward and hand-written backward of the model; returns (y_L, grads)."""
    w1, w2, gamma, x, ct = (np.asarray(a, np.float64) for a in (w1, w2, gamma, x, ct))
    H = x.shape[-1]
    r, y = x, x
    saved = []
    for l in range(w1.shape[0]):
        h = np.tanh(y @ w1[l])
        rn = h @ w2[l] + r
        inv = 1.0 / np.sqrt(np.mean(rn * rn, -1, keepdims=True) + EPS)
        saved.append((y, h, rn, inv))
        r, y = rn, rn * inv * gamma[l]
    out = y
    g = {k: np.zeros_like(v) for k, v in (("w1", w1), ("w2", w2), ("gamma", gamma))}
    ct_y, ct_r = ct, np.zeros_like(ct)
    for l in reversed(range(w1.shape[0])):
        y_in, h, rn, inv = saved[l]
        g["gamma"][l] = np.sum(ct_y * rn * inv, axis=0)
        cy = ct_y * gamma[l]
        ct_rn = ct_r + cy * inv - rn * inv**3 / H * np.sum(cy * rn, -1, keepdims=True)
        g["w2"][l] = h.T @ ct_rn
        ct_a = (ct_rn @ w2[l].T) * (1.0 - h * h)
        g["w1"][l] = y_in.T @ ct_a
        ct_y, ct_r = ct_a @ w1[l].T, ct_rn  # the residual passes its cotangent through
    g["x"] = ct_y + ct_r
    return out, g


def errors(got, want, dtype):
    """(max error in ulps of scale, normwise relative error) of one tensor."""
    got = np.asarray(got, np.float64)
    scale = float(np.max(np.abs(want)))
    ulp = ULP1[dtype] * 2.0 ** np.floor(np.log2(scale)) if scale > 0 else 1.0
    rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))
    return float(np.max(np.abs(got - want)) / ulp), rel


def run(
    jax,
    jnp,
    jf,
    mesh,
    P,
    seed,
    *,
    dtypes=("bfloat16", "float32"),
    layers=2,
    tokens=16,
    hidden=1024,
    ffn=2048,
):
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax_fusedar.ops import reference

    def place(spec, full):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])

    def gather(arr):
        return np.asarray(multihost_utils.process_allgather(arr, tiled=True))

    specs = (P(None, None, "tp"), P(None, "tp", None), P(), P())
    stats = {}
    for dtype in dtypes:
        w1, w2, gamma, x, ct = draw(seed, dtype, layers, tokens, hidden, ffn)
        ws = jax_workspace(jf, mesh, tokens, hidden, jnp.dtype(dtype))

        def fused(p, r, g):
            kw = dict(axis_name="tp", workspace=ws, rms_eps=EPS, strict=True)
            o = jf.allreduce_fusion(p, residual=r, rms_gamma=g, **kw)
            return o.residual_out, o.norm_out

        def unfused(p, r, g):
            _, r, y = reference.allreduce_fusion_reference(
                p, r, g, axis_name="tp", pattern=1, rms_eps=EPS, weight_bias=0.0
            )
            return r, y

        def model(combine):
            def body(w1, w2, gamma, x):
                r, y = x, x
                for l in range(layers):
                    r, y = combine(jnp.tanh(y @ w1[l]) @ w2[l], r, gamma[l])
                return y

            f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())

            def loss(params, ct):
                return jnp.sum(f(*params).astype(jnp.float32) * ct.astype(jnp.float32))

            return jax.jit(jax.grad(loss))

        params = tuple(place(s, a) for s, a in zip(specs, (w1, w2, gamma, x)))
        ct_g = place(P(), ct)
        grad_fused, grad_unfused = model(fused), model(unfused)
        compiled = grad_fused.lower(params, ct_g).compile().as_text()
        got = [gather(g) for g in grad_fused(params, ct_g)]
        ref = [gather(g) for g in grad_unfused(params, ct_g)]
        ws.destroy()
        _, want = oracle_grads(w1, w2, gamma, x, ct)
        per = {}
        for name, a, b in zip(NAMES, got, ref):
            fe, fr = errors(a, want[name], dtype)
            ue, ur = errors(b, want[name], dtype)
            bits = lambda t: np.asarray(t).view(f"u{t.itemsize}")
            per[name] = dict(fused_ulps=fe, unfused_ulps=ue, fused_rel=fr, unfused_rel=ur)
            per[name]["finite"] = bool(np.isfinite(a).all())
            per[name]["fused_vs_unfused_diffs"] = int(np.count_nonzero(bits(a) != bits(b)))
        calls = compiled.count("jax_fusedar_allreduce_fusion_v2")
        stats[dtype] = {"grads": per, "backend": ws.backend, "custom_calls": calls}
    return stats
