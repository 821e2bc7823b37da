"""JAX vs torch bitwise parity of the fused op (tests/gpu/test_parity.py).

Phase 1 runs every sm90 pattern (0, 1, 2, 4, 8, 9, 10, 11), bf16 and fp16, a few shapes, one-
and two-shot forced, N ranks (2, 4 or 8), and writes the inputs (float32 of the dtype-rounded
values) and each rank's output bytes to ``parity.npz``, ``parity_r<rank>.npz`` and
``parity.json``: ``jax_phase`` in one process driving N GPUs (the single-process peer-pointer
workspace), or, with fewer GPUs than ranks, ``jax_rank_phase`` in N `jax.distributed`
processes sharing them (CUDA IPC).

Phase 2 (``torch_phase``, N gloo processes, our IPC workspace) runs torch_compat on the same
inputs, use_oneshot, fp32_acc, eps and scales, and counts per case, pattern and output the
elements whose bytes differ from JAX's of the same TP rank; both sides are also held to the
float64 oracle (tests/oracles/oracle.py, quant_oracle.py). Phase 1 also runs on CPU and phase
2's per-case logic with a simulated kernel in tests/torch/test_worker_plumbing.py.
"""

import json
import os

import numpy as np

from tests.gpu.workers import torch_workers as tw
from tests.gpu.workers.common import counters, jax_workspace, jit_shard_map

PATTERNS = (0, 1, 2, 4, 8, 9, 10, 11)
GROUP = tw.GROUP
# JAX's AllReduceFusionOutputs fields -> torch_compat's argument names
JAX_TO_TORCH = {"allreduce_out": "output"}
JAX_TO_TORCH.update({n: n for n in ("residual_out", "norm_out", "quant_out", "scale_out")})
FLOATS = ("output", "residual_out", "norm_out")


def case_list(seed, tokens, hiddens, dtypes, world=2):
    from tests.gpu.harness import shape_cases

    shapes = [(d, *c) for d in dtypes for c in shape_cases(tokens, hiddens, world)]
    return [
        {"case": i, "seed": seed * 1000 + i, "dtype": d, "hidden": h, "m": m, "oneshot": o}
        for i, (d, h, m, o) in enumerate(shapes)
    ]


def _as_bytes(a):
    """Raw bytes of a numpy array whose dtype numpy may not know (bf16, e4m3): uint8 with
    the last dimension scaled by the item size; float32/int32 stay as they are."""
    a = np.ascontiguousarray(a)
    if a.dtype in (np.float32, np.int32):
        return a
    return a.view(np.uint8)


def jax_phase(rank, world, chan, *, out_dir, seed, tokens, hiddens, dtypes, platform="cuda", tp=2):
    """Phase 1 in this one process, driving ``tp`` devices."""
    os.environ["JAX_PLATFORMS"] = platform
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if platform == "cpu":
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={tp}"
    import jax

    devices = jax.devices()[:tp]
    assert len(devices) == tp, f"need {tp} devices, got {jax.devices()}"
    return _run_jax(jax, devices, list(range(tp)), out_dir, seed, tokens, hiddens, dtypes)


def jax_rank_phase(
    rank, world, chan, *, port, out_dir, seed, tokens, hiddens, dtypes, platform="cuda"
):
    """Phase 1 as this rank's `jax.distributed` process (rank r on GPU r % G; on CPUs one
    device per process over gloo; the XLA flags this process has)."""
    from tests.gpu.workers.jax_multiprocess import _setup

    jax = _setup(rank, world, port, os.environ.get("XLA_FLAGS", ""), platform)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    out = _run_jax(jax, devices, [rank], out_dir, seed, tokens, hiddens, dtypes)
    jax.distributed.shutdown()
    return out


def _run_jax(jax, devices, local_ranks, out_dir, seed, tokens, hiddens, dtypes):
    """Every case on the mesh of ``devices`` (TP rank = position): the outputs of this
    process's ``local_ranks`` to parity_r<rank>.npz; with rank 0, the inputs and parity.json."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    import jax_fusedar as jf
    from tests.gpu.harness import draw_case

    world = len(devices)
    mesh = Mesh(np.array(devices), ("tp",))
    arrays, devs = {}, [str(d) for d in devices]
    meta = {"cases": [], "jax": jax.__version__, "devices": devs, "outputs": {}, "world": world}
    outputs = {r: {} for r in local_ranks}
    cases = case_list(seed, tokens, hiddens, dtypes, world)
    backends = {}
    for dtype in dtypes:
        jdt = jnp.dtype(dtype)
        ws = jax_workspace(jf, mesh, max(tokens), max(hiddens), jdt)
        backends[dtype] = ws.backend
        for c in (c for c in cases if c["dtype"] == dtype):
            m, hidden, oneshot = c["m"], c["hidden"], c["oneshot"]
            xs, res, gam = draw_case(c["seed"], world, m, hidden)
            xs = [x.astype(jdt) for x in xs]
            res, gam = res.astype(jdt), gam.astype(jdt)
            ref = tw.group_oracle(xs, res, gam)  # it takes each as float64
            sf = np.asarray([tw.static_scale(ref)], np.float32)
            k = f"c{c['case']}"
            for r, x in enumerate(xs):
                arrays[f"{k}/x{r}"] = x.astype(np.float32)
            arrays[f"{k}/res"], arrays[f"{k}/gam"] = res.astype(np.float32), gam.astype(np.float32)
            arrays[f"{k}/sf"] = sf

            def f(x, r, g, s, oneshot=oneshot):
                outs = []
                for p in PATTERNS:
                    kw = dict(axis_name="tp", workspace=ws, pattern=p, use_oneshot=oneshot)
                    kw.update(fp32_acc=True, strict=True)
                    if p != 0:
                        kw.update(residual=r, rms_gamma=g, rms_eps=tw.RMS_EPS, weight_bias=0.0)
                    if p in (2, 4):
                        kw["scale_factor"] = s
                    if p in (8, 9):
                        kw["block_quant_group_size"] = GROUP
                    o = jf.allreduce_fusion(x, **kw)
                    outs.append({n: v for n, v in o._asdict().items() if v is not None})
                return outs

            fn = jit_shard_map(jax, f, mesh, (P("tp"), P(), P(), P()), P())

            def put(a, spec):  # this process's part of the global array
                return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), a)

            mine = np.concatenate([xs[r] for r in local_ranks])
            outs = fn(put(mine, P("tp")), put(res, P()), put(gam, P()), put(sf, P()))
            for p, o in zip(PATTERNS, outs):
                meta["outputs"][str(p)] = sorted(o)
                for name, arr in o.items():
                    for r in local_ranks:
                        shard = next(s for s in arr.addressable_shards if s.device == devices[r])
                        outputs[r][f"{k}/p{p}/{name}/r{r}"] = _as_bytes(np.asarray(shard.data))
            meta["cases"].append(c)
        ws.destroy()
    meta["backends"] = backends
    for r in local_ranks:
        np.savez(os.path.join(out_dir, f"parity_r{r}.npz"), **outputs[r])
    if 0 in local_ranks:
        np.savez(os.path.join(out_dir, "parity.npz"), **arrays)
        with open(os.path.join(out_dir, "parity.json"), "w") as fh:
            json.dump(meta, fh)
    out = {"cases": len(meta["cases"]), "backends": backends, "jax": jax.__version__}
    return {**out, "devices": meta["devices"], "world": world}


def load(out_dir):
    """(meta, data) of phase 1: parity.json and every parity*.npz merged into one dict."""
    with open(os.path.join(out_dir, "parity.json")) as fh:
        meta = json.load(fh)
    data = dict(np.load(os.path.join(out_dir, "parity.npz")))
    for r in range(meta["world"]):
        data.update(np.load(os.path.join(out_dir, f"parity_r{r}.npz")))
    return meta, data


def _values(raw, dtype):
    """JAX's stored bytes of a float output -> float64 values."""
    import ml_dtypes

    dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    return raw.view(dt).astype(np.float64)


def compare_case(torch, tc, ws, device, data, c, rank, sync, world=2):
    """Case ``c`` through torch_compat on this rank against JAX's outputs of the same TP rank:
    {"diffs", "torch"/"jax" oracle errors, "quant_torch"/"quant_jax" quant_stats}."""
    from tests.gpu.harness import worst_of

    k = f"c{c['case']}"
    dtype, m, hidden = c["dtype"], c["m"], c["hidden"]
    dt = tw._torch_dtype(torch, dtype)
    xs = [data[f"{k}/x{r}"] for r in range(world)]
    xs64 = [x.astype(np.float64) for x in xs]
    res, gam, sf = data[f"{k}/res"], data[f"{k}/gam"], data[f"{k}/sf"]
    res64, gam64 = res.astype(np.float64), gam.astype(np.float64)
    ref = tw.group_oracle(xs64, res64, gam64)
    x = tw.to_torch(torch, xs[rank], dt, device)
    r_d, g_d = tw.to_torch(torch, res, dt, device), tw.to_torch(torch, gam, dt, device)
    sf_d = torch.from_numpy(sf).to(device)
    diffs, by_torch, by_jax = {}, {}, {}
    plain = ("allreduce", "residual", "norm", "allreduce_bound", "residual_bound", "norm_own")
    err_t = {**dict.fromkeys(plain, 0.0), "nans": 0}
    err_j = dict(err_t)
    for p in PATTERNS:
        outs = tw.new_outputs(torch, p, m, hidden, dt, device, GROUP)
        # fp32_acc=True and wb=0.0, call_pattern's defaults, as on the JAX side
        tw.call_pattern(tc, ws, p, x, r_d, g_d, outs, sf=sf_d, group=GROUP, oneshot=c["oneshot"])
        sync()
        got = tw.outputs_to_numpy(torch, outs)
        jx, d = {}, {}
        for jname, tname in JAX_TO_TORCH.items():
            key = f"{k}/p{p}/{jname}/r{rank}"
            if key not in data:
                assert tname not in got, (p, tname)
                continue
            raw = data[key]
            jx[tname] = _values(raw, dtype) if tname in FLOATS else raw
            if tname in FLOATS:
                mine, theirs = got[tname + "_bytes"].view(np.uint16), raw.view(np.uint16)
            elif tname == "quant_out":
                mine, theirs = got[tname], raw
            elif p in (8, 9):  # dense (K, T) int32: compare the written tokens
                mine, theirs = got[tname][:, :m], raw[:, :m]
            else:  # dynamic scales float32 [M, 1]
                mine, theirs = got[tname].view(np.uint32), raw.view(np.uint32)
            if mine.shape != theirs.shape:
                d[tname] = f"shape {mine.shape} vs JAX {theirs.shape}"
            else:
                d[tname] = int(np.sum(mine != theirs))
        diffs[p] = d
        for src, errs in ((got, err_t), (jx, err_j)):
            floats = {n: v for n, v in src.items() if n in FLOATS}
            e = tw.plain_errors(floats, ref, res64, gam64, dtype, 0.0, xs=xs64)
            worst_of(errs, {n: v for n, v in e.items() if n != "nans"})
            errs["nans"] += e["nans"]
        by_torch[p], by_jax[p] = got, jx
    label = f"{dtype} {m}x{hidden} {'one' if c['oneshot'] else 'two'}-shot"
    args = (ref, res64, gam64, dtype, sf[0], GROUP, label)
    q_t, q_j = (
        tw.quant_stats(tw.new_quant_stats(), by, *args, xs=xs64) for by in (by_torch, by_jax)
    )
    return {"diffs": diffs, "torch": err_t, "jax": err_j, "quant_torch": q_t, "quant_jax": q_j}


def merge_quant(total, q):
    from tests.gpu.harness import worst_of

    for k in ("cases", "elements", "worse", "group_scale_mismatch", "poisoned"):
        total[k] += q[k]
    for k in total["steps1"]:
        total["steps1"][k] += q["steps1"][k]
    keys = ("dyn_scale_ulps", "residual", "norm", "residual_bound", "norm_own")
    worst_of(total, {k: q[k] for k in keys if k in q})
    total["twin_diffs"] += q["twin_diffs"]
    return total


def torch_phase(rank, world, chan, *, port, out_dir):
    from tests.gpu.harness import worst_of

    with tw._gloo(rank, world, port) as (torch, dist, device, tc):
        meta, data = load(out_dir)
        assert meta["world"] == world, (meta["world"], world)
        cases = meta["cases"]
        tokens, hidden = max(c["m"] for c in cases), max(c["hidden"] for c in cases)
        ws = tw._workspace(tc, torch, world, rank, tokens, hidden)
        per_case, differing = [], {}
        worst = {s: counters("nans", "allreduce residual norm") for s in ("torch", "jax")}
        quant = {s: tw.new_quant_stats() for s in ("torch", "jax")}
        for c in cases:
            out = compare_case(torch, tc, ws, device, data, c, rank, torch.cuda.synchronize, world)
            nz = {p: {n: v for n, v in d.items() if v != 0} for p, d in out["diffs"].items()}
            nz = {p: d for p, d in nz.items() if d}
            per_case.append({**c, "differing": nz})
            for p, d in nz.items():
                for n, v in d.items():
                    key = f"p{p}/{n}"
                    differing[key] = differing.get(key, 0) + (v if isinstance(v, int) else 1)
            for s in ("torch", "jax"):
                worst_of(worst[s], {n: v for n, v in out[s].items() if n != "nans"})
                worst[s]["nans"] += out[s]["nans"]
                merge_quant(quant[s], out[f"quant_{s}"])
        dist.barrier()
        ws.destroy()
        out = {"rank": rank, "cases": len(cases), "differing_elements": differing}
        return {**out, "per_case": per_case, "worst": worst, "quant": quant}
