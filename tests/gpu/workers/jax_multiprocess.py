"""Per-process body of the JAX GPU tests: `jax.distributed`, one GPU per process (rank r on GPU
r % G, so processes share a GPU where there are fewer), driving the real XLA FFI custom call
(handler, registry, IPC workspace over JAX's key-value store) under jit + shard_map with the
default check_vma=True. On platform "cpu" the same bodies run on JAX's reference path, one CPU
device per process over gloo (the CPU tests' dry run of these workers). Tasks:

* "parity":  tokens x hidden x dtype x one/two-shot against the float64 oracle: the
             accumulation bounds at every world size (fp32_acc alternating), the two-rank
             ulp bounds at 2 ranks;
* "loop":    10,000 consecutive calls in one jitted fori_loop, every call checked in-graph
             against precomputed oracle bounds (the count of violations must be 0);
* "model":   a 64-layer TP MLP: the fused model, the same math unfused on one device (no
             collectives, so it also runs where two ranks share a GPU) and a float64
             numpy model; the fused one must be as accurate as the unfused one;
* "quant", "nvfp4", "grad", "handler_errors", "batching": jax_<task>.py's run() (FP8
  patterns; NVFP4 on sm100+; gradients of a TP MLP; direct calls of the FFI target with wrong
  results or attributes; vmap and N-D calls folded into tokens on the kernel).
"""

import os

import numpy as np

from tests.gpu.workers.common import counters, jax_workspace, jit_shard_map


def _setup(rank, world, port, xla_flags, platform="cuda"):
    os.environ["JAX_PLATFORMS"] = platform
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["XLA_FLAGS"] = xla_flags
    from tests.gpu.harness import device_for
    from tests.gpu.workers.common import jax_distributed

    if platform == "cpu":
        os.environ["JAX_NUM_CPU_DEVICES"] = "1"
        return jax_distributed(rank, world, port, platform)
    return jax_distributed(rank, world, port, platform, [device_for(rank)])


def _tp_mesh(jax):
    """A "tp" mesh of every device, ordered by process: TP rank r is process r's device."""
    from jax.sharding import Mesh

    return Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))), ("tp",))


def _global(jax, mesh, spec, local):
    from jax.sharding import NamedSharding

    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)


def _local(arr):
    return np.asarray(arr.addressable_data(0)).astype(np.float64)


def worker(rank, world, chan, *, port, xla_flags, task, seed, platform="cuda", **kw):
    jax = _setup(rank, world, port, xla_flags, platform)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import jax_fusedar as jf
    from tests.oracles import oracle

    mesh = _tp_mesh(jax)
    out = {"rank": rank, "jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
    out["world"] = world
    common = (jax, jnp, jf, oracle, mesh, P, rank, world, seed)
    if task == "parity":
        out["worst"] = _parity(*common, kernel=platform == "cuda", **kw)
    elif task == "loop":
        out["loop"] = _loop(*common, **kw)
    elif task == "model":
        out["model"] = _model(jax, jnp, jf, mesh, P, rank, world, seed, **kw)
    elif task == "grad":
        from tests.gpu.workers import jax_grad

        out["grad"] = jax_grad.run(jax, jnp, jf, mesh, P, seed, **kw)
    elif task in ("quant", "nvfp4", "batching", "handler_errors"):
        # tests/gpu/workers/jax_<task>.py: run() takes the same arguments in each; batching
        # takes only whether the kernel serves the calls.
        import importlib

        extra = {"kernel": platform == "cuda"} if task == "batching" else kw
        glob = lambda spec, a: _global(jax, mesh, spec, a)
        run = importlib.import_module(f"tests.gpu.workers.jax_{task}").run
        out[task] = run(jax, jnp, jf, mesh, P, rank, world, seed, glob=glob, local=_local, **extra)
    jax.distributed.shutdown()
    return out


def _parity(jax, jnp, jf, oracle, mesh, P, rank, world, seed, tokens, hiddens, kernel=True):
    """Per dtype, the worst errors (harness.bound_problems's keys), and per fp32_acc the worst
    two-rank ulps (what fp32_acc=False costs at this world size, reported)."""
    from tests.gpu.harness import draw_case, shape_cases, worst_of
    from tests.gpu.workers.common import plain_ulps

    worst = {}
    case = 0
    for dtype in ("bfloat16", "float16", "float32"):
        jdt = jnp.dtype(dtype)
        w = counters("cases", "residual norm allreduce", ulps_fp32_acc={}, ulps_no_fp32_acc={})
        worst[dtype] = w
        ws = jax_workspace(jf, mesh, max(tokens), max(hiddens), jdt)
        assert ws.backend == ("trtllm" if kernel else "xla"), ws
        for hidden, m, oneshot in shape_cases(tokens, hiddens, world):
            case += 1
            xs, res, gam = draw_case(seed + case, world, m, hidden, jdt)
            wb, acc = float(case % 2), case % 3 != 2

            def f(x, r, g, oneshot=oneshot, wb=wb, acc=acc):
                # fallback: the CPU dry run, the kernel's additions, whose bounds are checked
                kw = dict(axis_name="tp", workspace=ws, use_oneshot=oneshot, fp32_acc=acc)
                kw.update(strict=True, fallback="kernel_exact")
                o = jf.allreduce_fusion(x, residual=r, rms_gamma=g, weight_bias=wb, **kw)
                a = jf.allreduce_fusion(x, pattern=jf.AllReduceFusionPattern.kAllReduce, **kw)
                return o.residual_out, o.norm_out, a.allreduce_out

            fn = jit_shard_map(jax, f, mesh, (P("tp"), P(), P()), (P(), P(), P()))
            args = [
                _global(jax, mesh, s, a) for s, a in ((P("tp"), xs[rank]), (P(), res), (P(), gam))
            ]
            r_out, n_out, a_out = fn(*args)
            x64 = [x.astype(np.float64) for x in xs]
            r64, g64 = res.astype(np.float64), gam.astype(np.float64)
            got = dict(residual_out=_local(r_out), norm_out=_local(n_out))
            got["allreduce_out"] = _local(a_out)
            ulps = plain_ulps(x64, r64, g64, dtype, **got, wb=wb)
            worst_of(w, ulps)
            worst_of(w["ulps_fp32_acc" if acc else "ulps_no_fp32_acc"], ulps)
            kw = dict(fp32_acc=acc, rms_eps=1e-6, weight_bias=wb, dtype_name=dtype)
            worst_of(w, oracle.accumulation_errors(x64, r64, g64, **got, **kw))
            w["cases"] += 1
        ws.destroy()
        if dtype == "bfloat16" and kernel:
            # A compiled program that outlives its workspace gets an FFI error, not a crash.
            try:
                fn(*args)[0].block_until_ready()
                worst["destroyed_workspace_error"] = "no error"
            except Exception as e:  # XlaRuntimeError
                worst["destroyed_workspace_error"] = str(e)[:300]
    return worst


def _loop(jax, jnp, jf, oracle, mesh, P, rank, world, seed, calls, m, hidden, period=7):
    """`calls` fused calls in one fori_loop; call i uses input set i % period and is compared
    in-graph with its precomputed float64 oracle scaled by the ulp bounds."""
    rng = np.random.default_rng(seed)
    jdt = jnp.bfloat16
    xs = rng.standard_normal((period, world, m, hidden), dtype=np.float32).astype(jdt)
    res = rng.standard_normal((period, m, hidden), dtype=np.float32).astype(jdt)
    gam = rng.uniform(-2, 2, hidden).astype(np.float32).astype(jdt)
    ref_r, ref_y, tol_r, tol_y = [], [], [], []
    g64 = gam.astype(np.float64)
    for k in range(period):
        x64, r64 = [xs[k, r].astype(np.float64) for r in range(world)], res[k].astype(np.float64)
        s, r, y, inv = oracle.fused_reference(x64, r64, g64, rms_eps=1e-6, weight_bias=0.0)
        # The residual's error: within an ulp of |s| + |res| at 2 ranks, within the
        # accumulation bound (fp32_acc=True, the default) at any world size.
        carried = np.maximum(
            oracle.ulp(np.abs(s) + np.abs(r64), "bfloat16"),
            oracle.residual_error_bound(x64, res[k], "bfloat16", fp32_acc=True),
        )
        ref_r.append(r), ref_y.append(y), tol_r.append(carried)
        tol_y.append(3.0 * (carried * inv * np.abs(g64) + oracle.ulp(y, "bfloat16")))
    f32 = lambda a: np.stack(a).astype(np.float32)
    ws = jax_workspace(jf, mesh, m, hidden, jdt)

    def body(xs_l, res, gam, ref_r, ref_y, tol_r, tol_y):
        def step(i, carry):
            bad, last = carry
            k = i % period
            # fallback: the CPU dry run, the kernel's additions, whose bounds are checked
            kw = dict(axis_name="tp", workspace=ws, strict=True, fallback="kernel_exact")
            o = jf.allreduce_fusion(xs_l[k], residual=res[k], rms_gamma=gam, **kw)
            e_r = jnp.abs(o.residual_out.astype(jnp.float32) - ref_r[k]) > tol_r[k]
            e_y = jnp.abs(o.norm_out.astype(jnp.float32) - ref_y[k]) > tol_y[k]
            return bad + jnp.sum(e_r) + jnp.sum(e_y), o.norm_out

        bad0 = jnp.zeros((), jnp.int32)
        return jax.lax.fori_loop(0, calls, step, (bad0, jnp.zeros((m, hidden), jdt)))

    fn = jit_shard_map(jax, body, mesh, (P(None, "tp"),) + (P(),) * 6, (P(), P()))
    local_xs = xs[:, rank]  # [period, m, hidden], this rank's partials
    replicated = (res, gam, f32(ref_r), f32(ref_y), f32(tol_r), f32(tol_y))
    args = [_global(jax, mesh, P(None, "tp"), local_xs)]
    args += [_global(jax, mesh, P(), a) for a in replicated]
    import time

    bad, _ = fn(*args)
    bad.block_until_ready()
    t0 = time.perf_counter()
    bad, _ = fn(*args)
    bad.block_until_ready()
    elapsed = time.perf_counter() - t0
    ws.destroy()
    out = {"calls": calls, "violations": int(np.asarray(bad.addressable_data(0)))}
    return {**out, "us_per_call": elapsed / calls * 1e6, "m": m, "hidden": hidden}


def _model(jax, jnp, jf, mesh, P, rank, world, seed, layers, m, hidden, ffn):
    """A `layers`-deep TP MLP: fused op vs the same math unfused on this one device."""
    rng = np.random.default_rng(seed)
    jdt = jnp.bfloat16
    f_local = ffn // world
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    w_in = (normal(layers, world, hidden, f_local) / np.sqrt(hidden)).astype(jdt)
    w_out = (normal(layers, world, f_local, hidden) / np.sqrt(ffn)).astype(jdt)
    gam = rng.uniform(0.5, 1.5, (layers, hidden)).astype(np.float32).astype(jdt)
    emb = normal(m, hidden).astype(jdt)
    ws = jax_workspace(jf, mesh, m, hidden, jdt)

    def fused(w_in, w_out, gam, emb):
        res, h = emb, emb
        for l in range(layers):
            part = jnp.dot(jax.nn.silu(jnp.dot(h, w_in[l, 0])), w_out[l, 0])
            kw = dict(axis_name="tp", workspace=ws, strict=True)
            o = jf.allreduce_fusion(part, residual=res, rms_gamma=gam[l], **kw)
            res, h = o.residual_out, o.norm_out
        return h

    def bf16(a):  # materialise a bf16 rounding XLA's excess-precision fusion could skip
        return jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=7)

    def unfused(w_in, w_out, gam, emb):  # plain jnp on one device, every rank's partial sum
        res, h = emb, emb
        for l in range(layers):
            # In a real TP run each partial sum is a bf16 array before the all-reduce.
            part = lambda r: jnp.dot(jax.nn.silu(jnp.dot(h, w_in[l, r])), w_out[l, r])
            parts = [bf16(part(r)) for r in range(world)]
            f32 = jnp.float32
            s = bf16(sum(p.astype(f32) for p in parts)).astype(jdt)
            res = bf16(s.astype(f32) + res.astype(f32)).astype(jdt)
            r32 = res.astype(f32)
            inv = jax.lax.rsqrt(jnp.mean(r32 * r32, -1, keepdims=True) + 1e-6)
            h = (r32 * inv * gam[l].astype(f32)).astype(jdt)
        return h

    fn = jit_shard_map(jax, fused, mesh, (P(None, "tp"), P(None, "tp"), P(), P()), P())
    mine = lambda w: _global(jax, mesh, P(None, "tp"), w[:, rank : rank + 1])
    args = (mine(w_in), mine(w_out), _global(jax, mesh, P(), gam), _global(jax, mesh, P(), emb))
    got = _local(fn(*args))
    # Host launches per further execution: `layers` without command buffers; fewer (none
    # once captured) when XLA replays a CUDA graph, where the handler's host code never runs.
    from jax_fusedar.common import native

    def launch_count():  # without the native module (a CPU-only install) nothing launches
        return 0 if native.ext is None else native.ext.launch_count()

    launches = []
    for _ in range(3):
        before = launch_count()
        fn(*args).block_until_ready()
        launches.append(launch_count() - before)
    local_dev = jax.local_devices()[0]
    unf = np.asarray(
        jax.jit(unfused)(*[jax.device_put(a, local_dev) for a in (w_in, w_out, gam, emb)])
    ).astype(np.float64)
    exact = _model64(w_in, w_out, gam, emb)
    ws.destroy()

    def rel(a):
        return float(np.sqrt(np.mean((a - exact) ** 2) / np.mean(exact**2)))

    out = {"layers": layers, "host_launches_per_run": launches, "fused_vs_f64": rel(got)}
    out.update(unfused_vs_f64=rel(unf), fused_vs_unfused_max_abs=float(np.abs(got - unf).max()))
    return {**out, "finite": bool(np.isfinite(got).all())}


def _model64(w_in, w_out, gam, emb):
    """The same model in float64 numpy (weights as rounded to bf16): the accuracy yardstick."""
    w_in, w_out, gam = (a.astype(np.float64) for a in (w_in, w_out, gam))
    res = h = emb.astype(np.float64)
    for l in range(w_in.shape[0]):
        s = 0.0
        for r in range(w_in.shape[1]):
            a = h @ w_in[l, r]
            s = s + (a / (1.0 + np.exp(-a))) @ w_out[l, r]
        res = s + res
        h = res / np.sqrt(np.mean(res * res, -1, keepdims=True) + 1e-6) * gam[l]
    return h
