"""JAX vs torch bitwise parity of the fused op (tests/gpu/test_parity.py).

Phase 1 (``jax_phase``, one process driving both GPUs: ``jax.shard_map`` over a 2-device
mesh, the single-process peer-pointer workspace): runs every pattern available on sm90
(0, 1, 2, 4, 8, 9, 10, 11) for bf16 and fp16 over a few shapes, one- and two-shot forced
explicitly, and writes the inputs (float32 of the dtype-rounded values) and each device's
outputs (raw bytes) to ``parity.npz`` + ``parity.json`` in a directory.

Phase 2 (``torch_phase``, two processes, one GPU each, gloo + our IPC workspace): loads
them, runs torch_compat.allreduce_fusion on the same inputs with the same use_oneshot,
fp32_acc, eps and scales, and counts, per case, pattern and output, the elements whose
bytes differ from JAX's output on the same device (TP rank); both sides are also checked
against the float64 oracle (tests/oracles/oracle.py, tests/oracles/quant_oracle.py).

The phase-1 body also runs on CPU (JAX's reference path, 2 virtual devices) and the
phase-2 per-case logic with a simulated kernel, in tests/torch/test_worker_plumbing.py.
"""
from __future__ import annotations

import json
import os

import numpy as np

from tests.gpu import torch_workers as tw

PATTERNS = (0, 1, 2, 4, 8, 9, 10, 11)
GROUP = tw.GROUP
# JAX's AllReduceFusionOutputs fields -> torch_compat's argument names
JAX_TO_TORCH = {"allreduce_out": "output", "residual_out": "residual_out",
                "norm_out": "norm_out", "quant_out": "quant_out", "scale_out": "scale_out"}


def case_list(seed, tokens, hiddens, dtypes, world=2):
    from tests.gpu.harness import shape_cases
    out = []
    for dtype in dtypes:
        for hidden, m, oneshot in shape_cases(tokens, hiddens, world):
            out.append({"case": len(out), "seed": seed * 1000 + len(out), "dtype": dtype,
                        "hidden": hidden, "m": m, "oneshot": oneshot})
    return out


def _as_bytes(a):
    """Raw bytes of a numpy array whose dtype numpy may not know (bf16, e4m3): uint8 with
    the last dimension scaled by the item size; float32/int32 stay as they are."""
    a = np.ascontiguousarray(a)
    if a.dtype in (np.float32, np.int32):
        return a
    return a.view(np.uint8)


def jax_phase(rank, world, chan, *, out_dir, seed, tokens, hiddens, dtypes, platform="cuda"):
    os.environ["JAX_PLATFORMS"] = platform
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if platform == "cpu":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_fusedar as jf
    from tests.gpu.harness import draw_case

    devices = jax.devices()[:2]
    assert len(devices) == 2, f"need 2 devices, got {jax.devices()}"
    mesh = Mesh(np.array(devices), ("tp",))
    arrays, meta = {}, {"cases": [], "jax": jax.__version__, "devices": [str(d) for d in devices],
                        "outputs": {}}
    cases = case_list(seed, tokens, hiddens, dtypes)
    backends = {}
    for dtype in dtypes:
        jdt = jnp.dtype(dtype)
        ws = jf.create_allreduce_fusion_workspace(mesh, "tp", max_token_num=max(tokens),
                                                  hidden_dim=max(hiddens), dtype=jdt)
        backends[dtype] = ws.backend
        for c in (c for c in cases if c["dtype"] == dtype):
            m, hidden, oneshot = c["m"], c["hidden"], c["oneshot"]
            xs, res, gam = draw_case(c["seed"], 2, m, hidden)
            xs = [x.astype(jdt) for x in xs]
            res, gam = res.astype(jdt), gam.astype(jdt)
            ref = tw.group_oracle([x.astype(np.float64) for x in xs], res.astype(np.float64),
                                  gam.astype(np.float64))
            sf = np.asarray([tw.static_scale(ref)], np.float32)
            k = f"c{c['case']}"
            arrays[f"{k}/x0"], arrays[f"{k}/x1"] = (x.astype(np.float32) for x in xs)
            arrays[f"{k}/res"], arrays[f"{k}/gam"] = res.astype(np.float32), gam.astype(np.float32)
            arrays[f"{k}/sf"] = sf

            def f(x, r, g, s, oneshot=oneshot):
                outs = []
                for p in PATTERNS:
                    kw = dict(axis_name="tp", workspace=ws, pattern=p, use_oneshot=oneshot,
                              fp32_acc=True, strict=True)
                    if p != 0:
                        kw.update(residual=r, rms_gamma=g, rms_eps=tw.RMS_EPS, weight_bias=0.0)
                    if p in (2, 4):
                        kw["scale_factor"] = s
                    if p in (8, 9):
                        kw["block_quant_group_size"] = GROUP
                    o = jf.allreduce_fusion(x, **kw)
                    outs.append({n: v for n, v in o._asdict().items() if v is not None})
                return outs

            fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("tp"), P(), P(), P()),
                                       out_specs=P()))
            put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
            outs = fn(put(np.concatenate(xs), P("tp")), put(res, P()), put(gam, P()),
                      put(sf, P()))
            for p, o in zip(PATTERNS, outs):
                meta["outputs"][str(p)] = sorted(o)
                for name, arr in o.items():
                    for r, d in enumerate(devices):
                        shard = next(s for s in arr.addressable_shards if s.device == d)
                        arrays[f"{k}/p{p}/{name}/r{r}"] = _as_bytes(np.asarray(shard.data))
            meta["cases"].append(c)
        ws.destroy()
    meta["backends"] = backends
    np.savez(os.path.join(out_dir, "parity.npz"), **arrays)
    with open(os.path.join(out_dir, "parity.json"), "w") as fh:
        json.dump(meta, fh)
    return {"cases": len(meta["cases"]), "backends": backends, "jax": jax.__version__,
            "devices": meta["devices"]}


def _values(raw, dtype):
    """JAX's stored bytes of a float output -> float64 values."""
    import ml_dtypes
    dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    return raw.view(dt).astype(np.float64)


def compare_case(torch, tc, ws, device, data, c, rank, sync):
    """Runs case ``c`` through torch_compat on this rank and compares with JAX's outputs of
    the same device. Returns {"diffs": {pattern: {output: differing elements}},
    "torch": oracle errors, "jax": oracle errors, "quant_torch"/"quant_jax": quant_stats}."""
    k = f"c{c['case']}"
    dtype, m, hidden = c["dtype"], c["m"], c["hidden"]
    dt = tw._torch_dtype(torch, dtype)
    xs = [data[f"{k}/x0"], data[f"{k}/x1"]]
    res, gam, sf = data[f"{k}/res"], data[f"{k}/gam"], data[f"{k}/sf"]
    ref = tw.group_oracle([x.astype(np.float64) for x in xs], res.astype(np.float64),
                          gam.astype(np.float64))
    res64, gam64 = res.astype(np.float64), gam.astype(np.float64)
    x = tw.to_torch(torch, xs[rank], dt, device)
    r_d, g_d = tw.to_torch(torch, res, dt, device), tw.to_torch(torch, gam, dt, device)
    sf_d = torch.from_numpy(sf).to(device)
    diffs, by_torch, by_jax = {}, {}, {}
    err_t = {"allreduce": 0.0, "residual": 0.0, "norm": 0.0, "nans": 0}
    err_j = dict(err_t)
    for p in PATTERNS:
        outs = tw.new_outputs(torch, p, m, hidden, dt, device, GROUP)
        tw.call_pattern(tc, ws, p, x, r_d, g_d, outs, sf=sf_d, group=GROUP,
                        oneshot=c["oneshot"], fp32_acc=True, wb=0.0)
        sync()
        got = tw.outputs_to_numpy(torch, outs)
        jx, d = {}, {}
        for jname, tname in JAX_TO_TORCH.items():
            key = f"{k}/p{p}/{jname}/r{rank}"
            if key not in data:
                assert tname not in got, (p, tname)
                continue
            raw = data[key]
            if tname in ("output", "residual_out", "norm_out"):
                mine = got[tname + "_bytes"].view(np.uint16)
                theirs = raw.view(np.uint16)
                jx[tname] = _values(raw, dtype)
            elif tname == "quant_out":
                mine, theirs = got[tname], raw
                jx[tname] = raw
            elif p in (8, 9):  # dense (K, T) int32: compare the written tokens
                mine, theirs = got[tname][:, :m], raw[:, :m]
                jx[tname] = raw
            else:  # dynamic scales float32 [M, 1]
                mine, theirs = got[tname].view(np.uint32), raw.view(np.uint32)
                jx[tname] = raw
            if mine.shape != theirs.shape:
                d[tname] = f"shape {mine.shape} vs JAX {theirs.shape}"
            else:
                d[tname] = int(np.sum(mine != theirs))
        diffs[p] = d
        for src, errs in ((got, err_t), (jx, err_j)):
            e = tw.plain_errors({n: v for n, v in src.items()
                                 if n in ("output", "residual_out", "norm_out")},
                                ref, res64, gam64, dtype, 0.0)
            for n in ("allreduce", "residual", "norm"):
                if n in e:
                    errs[n] = max(errs[n], e[n])
            errs["nans"] += e["nans"]
        by_torch[p], by_jax[p] = got, jx
    label = f"{dtype} {m}x{hidden} {'one' if c['oneshot'] else 'two'}-shot"
    q_t = tw.quant_stats(tw.new_quant_stats(), by_torch, ref, res64, gam64, dtype, sf[0],
                         GROUP, label)
    q_j = tw.quant_stats(tw.new_quant_stats(), by_jax, ref, res64, gam64, dtype, sf[0],
                         GROUP, label)
    return {"diffs": diffs, "torch": err_t, "jax": err_j, "quant_torch": q_t, "quant_jax": q_j}


def merge_quant(total, q):
    for k in ("cases", "elements", "worse", "group_scale_mismatch", "poisoned"):
        total[k] += q[k]
    for k in total["steps1"]:
        total["steps1"][k] += q["steps1"][k]
    for k in ("dyn_scale_ulps", "residual", "norm"):
        total[k] = max(total[k], q[k])
    total["twin_diffs"] += q["twin_diffs"]
    return total


def torch_phase(rank, world, chan, *, port, out_dir):
    torch, dist, device = tw._init(rank, world, port, rank)
    import torch_compat as tc

    try:
        with open(os.path.join(out_dir, "parity.json")) as fh:
            meta = json.load(fh)
        data = dict(np.load(os.path.join(out_dir, "parity.npz")))
        cases = meta["cases"]
        ws = tc.create_allreduce_fusion_workspace(
            "trtllm", world, rank, max(c["m"] for c in cases), max(c["hidden"] for c in cases),
            torch.bfloat16, timeout_s=120)
        per_case, differing = [], {}
        worst = {s: {"allreduce": 0.0, "residual": 0.0, "norm": 0.0, "nans": 0}
                 for s in ("torch", "jax")}
        quant = {s: tw.new_quant_stats() for s in ("torch", "jax")}
        for c in cases:
            out = compare_case(torch, tc, ws, device, data, c, rank, torch.cuda.synchronize)
            nz = {p: {n: v for n, v in d.items() if v != 0} for p, d in out["diffs"].items()}
            nz = {p: d for p, d in nz.items() if d}
            per_case.append({**c, "differing": nz})
            for p, d in nz.items():
                for n, v in d.items():
                    key = f"p{p}/{n}"
                    differing[key] = differing.get(key, 0) + (v if isinstance(v, int) else 1)
            for s in ("torch", "jax"):
                for n in ("allreduce", "residual", "norm"):
                    worst[s][n] = max(worst[s][n], out[s][n])
                worst[s]["nans"] += out[s]["nans"]
                merge_quant(quant[s], out[f"quant_{s}"])
        dist.barrier()
        ws.destroy()
        return {"rank": rank, "cases": len(cases), "differing_elements": differing,
                "per_case": per_case, "worst": worst, "quant": quant}
    finally:
        dist.destroy_process_group()
