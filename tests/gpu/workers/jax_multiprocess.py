"""Per-process body of the JAX GPU tests: `jax.distributed`, one GPU per process.

This drives the real XLA FFI custom call (handler, registry, IPC workspace over JAX's
key-value store) under jit + shard_map with the default check_vma=True. On a one-GPU
machine the processes share GPU 0 (rank r drives GPU r % G). On platform "cpu" the same
bodies run on JAX's reference path, one CPU device per process over gloo (the CPU tests'
dry run of these workers). Tasks:

* "parity":  tokens x hidden x dtype x one/two-shot against the float64 oracle: the
             accumulation bounds at every world size (fp32_acc alternating), the two-rank
             ulp bounds at 2 ranks;
* "loop":    10,000 consecutive calls in one jitted fori_loop, every call checked in-graph
             against precomputed oracle bounds (the count of violations must be 0);
* "model":   a 64-layer TP MLP: the fused model, the same math unfused on one device (no
             collectives, so it also runs where two ranks share a GPU) and a float64
             numpy model; the fused one must be as accurate as the unfused one;
* "quant":   the FP8 patterns (tests/gpu/workers/jax_quant.py);
* "nvfp4":   the NVFP4 patterns on sm100+ (tests/gpu/workers/jax_nvfp4.py);
* "grad":    gradients of a TP MLP, fused vs unfused vs float64 (tests/gpu/workers/jax_grad.py);
* "handler_errors": direct calls of the FFI target with wrong results or attributes
             (tests/gpu/workers/jax_handler_errors.py);
* "batching": vmap and N-D calls folded into tokens on the kernel, dense against the
             float64 oracle, MoE bit for bit against one call per element
             (tests/gpu/workers/jax_batching.py).
"""

from __future__ import annotations

import os

import numpy as np

from tests.gpu.workers.common import jit_shard_map


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
    out = {
        "rank": rank,
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "world": world,
    }
    if task == "parity":
        out["worst"] = _parity(
            jax, jnp, jf, oracle, mesh, P, rank, world, seed, kernel=platform == "cuda", **kw
        )
    elif task == "loop":
        out["loop"] = _loop(jax, jnp, jf, oracle, mesh, P, rank, world, seed, **kw)
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
        out[task] = importlib.import_module(f"tests.gpu.workers.jax_{task}").run(
            jax,
            jnp,
            jf,
            mesh,
            P,
            rank,
            world,
            seed,
            glob=lambda spec, a: _global(jax, mesh, spec, a),
            local=_local,
            **extra,
        )
    jax.distributed.shutdown()
    return out


def _parity(jax, jnp, jf, oracle, mesh, P, rank, world, seed, tokens, hiddens, kernel=True):
    """Per dtype, the worst errors (harness.bound_problems's keys) over the cases, and, per
    fp32_acc setting, the worst two-rank ulp measures (``ulps_fp32_acc`` /
    ``ulps_no_fp32_acc``: what fp32_acc=False costs at this world size, reported)."""
    from tests.gpu.harness import draw_case, shape_cases, worst_of
    from tests.gpu.workers.common import plain_ulps

    worst = {}
    case = 0
    for dtype in ("bfloat16", "float16", "float32"):
        jdt = jnp.dtype(dtype)
        w = worst[dtype] = {
            "residual": 0.0,
            "norm": 0.0,
            "allreduce": 0.0,
            "cases": 0,
            "ulps_fp32_acc": {},
            "ulps_no_fp32_acc": {},
        }
        ws = jf.create_allreduce_fusion_workspace(
            mesh, "tp", max_token_num=max(tokens), hidden_dim=max(hiddens), dtype=jdt
        )
        assert ws.backend == ("trtllm" if kernel else "xla"), ws
        for hidden, m, oneshot in shape_cases(tokens, hiddens, world):
            case += 1
            xs, res, gam = draw_case(seed + case, world, m, hidden, jdt)
            wb = float(case % 2)

            acc = case % 3 != 2

            def f(x, r, g, oneshot=oneshot, wb=wb, acc=acc):
                kw = dict(
                    axis_name="tp",
                    workspace=ws,
                    use_oneshot=oneshot,
                    fp32_acc=acc,
                    strict=True,
                    # the CPU dry run: the kernel's additions, whose bounds are checked
                    fallback="kernel_exact",
                )
                o = jf.allreduce_fusion(x, residual=r, rms_gamma=g, weight_bias=wb, **kw)
                a = jf.allreduce_fusion(x, pattern=jf.AllReduceFusionPattern.kAllReduce, **kw)
                return o.residual_out, o.norm_out, a.allreduce_out

            fn = jit_shard_map(jax, f, mesh, (P("tp"), P(), P()), (P(), P(), P()))
            r_out, n_out, a_out = fn(
                _global(jax, mesh, P("tp"), xs[rank]),
                _global(jax, mesh, P(), res),
                _global(jax, mesh, P(), gam),
            )
            x64 = [x.astype(np.float64) for x in xs]
            r64, g64 = res.astype(np.float64), gam.astype(np.float64)
            got = dict(
                residual_out=_local(r_out), norm_out=_local(n_out), allreduce_out=_local(a_out)
            )
            ulps = plain_ulps(x64, r64, g64, dtype, **got, wb=wb)
            worst_of(w, ulps)
            worst_of(w["ulps_fp32_acc" if acc else "ulps_no_fp32_acc"], ulps)
            bounds = oracle.accumulation_errors(
                x64, r64, g64, **got, fp32_acc=acc, rms_eps=1e-6, weight_bias=wb, dtype_name=dtype
            )
            worst_of(w, bounds)
            w["cases"] += 1
        ws.destroy()
        if dtype == "bfloat16" and kernel:
            # A compiled program that outlives its workspace gets an FFI error, not a crash.
            try:
                fn(
                    *[
                        _global(jax, mesh, s, a)
                        for s, a in ((P("tp"), xs[rank]), (P(), res), (P(), gam))
                    ]
                )[0].block_until_ready()
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
    for k in range(period):
        x64 = [xs[k, r].astype(np.float64) for r in range(world)]
        s, r, y, inv = oracle.fused_reference(
            x64, res[k].astype(np.float64), gam.astype(np.float64), rms_eps=1e-6, weight_bias=0.0
        )
        # The residual's error: within an ulp of |s| + |res| at 2 ranks, within the
        # accumulation bound (fp32_acc=True, the default) at any world size.
        carried = np.maximum(
            oracle.ulp(np.abs(s) + np.abs(res[k].astype(np.float64)), "bfloat16"),
            oracle.residual_error_bound(x64, res[k], "bfloat16", fp32_acc=True),
        )
        ref_r.append(r), ref_y.append(y), tol_r.append(carried)
        tol_y.append(
            3.0 * (carried * inv * np.abs(gam.astype(np.float64)) + oracle.ulp(y, "bfloat16"))
        )
    f32 = lambda a: np.stack(a).astype(np.float32)  # noqa: E731
    ws = jf.create_allreduce_fusion_workspace(
        mesh, "tp", max_token_num=m, hidden_dim=hidden, dtype=jdt
    )

    def body(xs_l, res, gam, ref_r, ref_y, tol_r, tol_y):
        def step(i, carry):
            bad, last = carry
            k = i % period
            o = jf.allreduce_fusion(
                xs_l[k],
                axis_name="tp",
                workspace=ws,
                residual=res[k],
                rms_gamma=gam,
                strict=True,
                # the CPU dry run: the kernel's additions, whose bounds are checked
                fallback="kernel_exact",
            )
            e_r = jnp.abs(o.residual_out.astype(jnp.float32) - ref_r[k]) > tol_r[k]
            e_y = jnp.abs(o.norm_out.astype(jnp.float32) - ref_y[k]) > tol_y[k]
            return bad + jnp.sum(e_r) + jnp.sum(e_y), o.norm_out

        bad0 = jnp.zeros((), jnp.int32)
        return jax.lax.fori_loop(0, calls, step, (bad0, jnp.zeros((m, hidden), jdt)))

    spec_rep = P()
    fn = jit_shard_map(jax, body, mesh, (P(None, "tp"),) + (spec_rep,) * 6, (P(), P()))
    local_xs = xs[:, rank]  # [period, m, hidden], this rank's partials
    args = [_global(jax, mesh, P(None, "tp"), local_xs)] + [
        _global(jax, mesh, spec_rep, a)
        for a in (res, gam, f32(ref_r), f32(ref_y), f32(tol_r), f32(tol_y))
    ]
    import time

    bad, _ = fn(*args)
    bad.block_until_ready()
    t0 = time.perf_counter()
    bad, _ = fn(*args)
    bad.block_until_ready()
    elapsed = time.perf_counter() - t0
    ws.destroy()
    return {
        "calls": calls,
        "violations": int(np.asarray(bad.addressable_data(0))),
        "us_per_call": elapsed / calls * 1e6,
        "m": m,
        "hidden": hidden,
    }


def _model(jax, jnp, jf, mesh, P, rank, world, seed, layers, m, hidden, ffn):
    """A `layers`-deep TP MLP: fused op vs the same math unfused on this one device."""
    rng = np.random.default_rng(seed)
    jdt = jnp.bfloat16
    f_local = ffn // world
    w_in = (
        rng.standard_normal((layers, world, hidden, f_local), dtype=np.float32) / np.sqrt(hidden)
    ).astype(jdt)
    w_out = (
        rng.standard_normal((layers, world, f_local, hidden), dtype=np.float32) / np.sqrt(ffn)
    ).astype(jdt)
    gam = rng.uniform(0.5, 1.5, (layers, hidden)).astype(np.float32).astype(jdt)
    emb = rng.standard_normal((m, hidden), dtype=np.float32).astype(jdt)
    ws = jf.create_allreduce_fusion_workspace(
        mesh, "tp", max_token_num=m, hidden_dim=hidden, dtype=jdt
    )

    def fused(w_in, w_out, gam, emb):
        res, h = emb, emb
        for l in range(layers):
            part = jnp.dot(jax.nn.silu(jnp.dot(h, w_in[l, 0])), w_out[l, 0])
            o = jf.allreduce_fusion(
                part, axis_name="tp", workspace=ws, residual=res, rms_gamma=gam[l], strict=True
            )
            res, h = o.residual_out, o.norm_out
        return h

    def bf16(a):  # materialise a bf16 rounding XLA's excess-precision fusion could skip
        return jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=7)

    def unfused(w_in, w_out, gam, emb):  # plain jnp on one device, every rank's partial sum
        res, h = emb, emb
        for l in range(layers):
            # In a real TP run each partial sum is a bf16 array before the all-reduce.
            parts = [
                bf16(jnp.dot(jax.nn.silu(jnp.dot(h, w_in[l, r])), w_out[l, r]))
                for r in range(world)
            ]
            s = bf16(sum(p.astype(jnp.float32) for p in parts)).astype(jdt)
            res = bf16(s.astype(jnp.float32) + res.astype(jnp.float32)).astype(jdt)
            r32 = res.astype(jnp.float32)
            h = (
                r32
                * jax.lax.rsqrt(jnp.mean(r32 * r32, -1, keepdims=True) + 1e-6)
                * gam[l].astype(jnp.float32)
            ).astype(jdt)
        return h

    fn = jit_shard_map(jax, fused, mesh, (P(None, "tp"), P(None, "tp"), P(), P()), P())
    args = (
        _global(jax, mesh, P(None, "tp"), w_in[:, rank : rank + 1]),
        _global(jax, mesh, P(None, "tp"), w_out[:, rank : rank + 1]),
        _global(jax, mesh, P(), gam),
        _global(jax, mesh, P(), emb),
    )
    got = fn(*args)
    got = _local(got)
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

    return {
        "layers": layers,
        "host_launches_per_run": launches,
        "fused_vs_f64": rel(got),
        "unfused_vs_f64": rel(unf),
        "fused_vs_unfused_max_abs": float(np.abs(got - unf).max()),
        "finite": bool(np.isfinite(got).all()),
    }


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
