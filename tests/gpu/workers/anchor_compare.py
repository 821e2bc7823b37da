"""Per-process body of tests/gpu/test_anchor.py: torch_compat against FlashInfer's own build.

Every rank joins torch.distributed over gloo, creates a torch_compat workspace and
FlashInfer's (backend "trtllm") and runs the same inputs through both ``allreduce_fusion``s:
patterns 0, 1, static FP8 4/2, dynamic FP8 11/10, per-token-group FP8 9/8 (group 128), bf16
and fp16, the sweep's shapes, one- and two-shot forced alike, fp32_acc True and False,
launch_with_pdl=True, every output poisoned first (NaN; e4m3 and UE8M0 bytes 0xFF). Both
compile the same kernel from the same header, so every output byte should agree: differing
bytes are counted per pattern and output (group scales over the whole (K, T) buffer).

Both are also held to the float64 oracle (tests/oracles/oracle.py): for both fp32_acc, the
accumulation bounds (norm_out against the RMSNorm of the build's own residual_out); with
fp32_acc=True also the ulps of the intermediate magnitudes; the quantized outputs against
tests/oracles/quant_oracle.py on the build's own norm_out (the ``...Out...`` twin's for 2, 10,
8), as jax_quant.py does: e4m3 codes one step apart and more, dynamic scales in fp32 ulps,
group scale bytes.

FlashInfer's quirks met here: patterns other than 0 and the dynamic FP8 ones allocate an
unused ``output`` when none is passed (we pass none, so they do); it returns the "most
downstream" output (norm_out, else quant_out, else output), which torch_compat mirrors.
"""

import time

import numpy as np

from jax_fusedar.common.patterns import TRAITS, AllReduceFusionPattern
from tests.gpu.workers.common import counters

GROUP = 128
RMS_EPS = 1e-6
# Each "...Out..." pattern before its twin: the twin's oracle quantizes the Out one's norm_out.
PATTERNS = (0, 1, 4, 2, 11, 10, 9, 8)
TWIN = {2: 4, 10: 11, 8: 9}
DTYPES = ("bfloat16", "float16")
IMPLS = ("ours", "anchor")
_KEEP = 4  # cases listed per differing output


def _np_dtype(name):
    import ml_dtypes

    return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[name]


def _outputs(torch, p, m, h, dtype, device):
    """Poisoned outputs of pattern ``p`` (torch_workers.new_outputs) and the buffers to compare
    (the group scales' whole (K, T) buffer)."""
    from tests.gpu.workers.torch_workers import new_outputs

    outs = new_outputs(torch, p, m, h, dtype, device, GROUP)
    base = outs.pop("_scale_buf", None)
    return outs, dict(outs, **({} if base is None else {"scale_out": base}))


def _call(fn, ws, p, x, residual, gamma, sf, outs, oneshot, fp32_acc):
    t = TRAITS[AllReduceFusionPattern(p)]
    kw = dict(input=x, workspace=ws, pattern=p, launch_with_pdl=True, rms_eps=RMS_EPS, **outs)
    kw.update(use_oneshot=oneshot, fp32_acc=fp32_acc)
    if t.has_residual:
        kw.update(residual_in=residual, rms_gamma=gamma)
    if t.uses_scale_factor:
        kw["scale_factor"] = sf
    if t.quant == "group_fp8":
        kw["block_quant_group_size"] = GROUP
    ret = fn(**kw)
    want = "norm_out" if t.has_norm_out else ("quant_out" if t.quant else "output")
    return ret is outs[want]


def _bytes(torch, t):
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(-1)


def _host(torch, buffers, dtype_name, m):
    """numpy copies: float outputs in the call dtype, quant bytes, scales."""
    out = {}
    for name, b in buffers.items():
        if name == "quant_out":
            out[name] = b.cpu().view(torch.uint8).numpy()
        elif name == "scale_out":
            out[name] = b.cpu().numpy()
        else:
            out[name] = b.float().cpu().numpy().astype(_np_dtype(dtype_name))
    return out


def _unwritten(name, a, m):
    """Poison left in an output the kernel should have written entirely."""
    if name == "quant_out":
        return int(np.sum((a & 0x7F) == 0x7F))
    if name == "scale_out":
        if a.dtype == np.int32:  # group scales: only the [:, :m] words hold scales
            return int(np.sum(a[:, :m] == -1))
        return int(np.isnan(a).sum())
    return int(np.isnan(a.astype(np.float32)).sum())


def _oracle_stats(host, dtype_name, ref, sf, m):
    """Errors of one build's fp32_acc=True outputs (``host[p][name]``) against the oracles."""
    from tests.gpu.workers.common import keep_max, scale_ulps
    from tests.oracles import oracle, quant_oracle

    s64, r64, y64, inv64, res64, gam64 = ref
    st = counters("worse group_scale_mismatch elements", "allreduce residual norm dyn_scale_ulps")
    st["steps1"] = {}
    f64 = lambda outs, k: outs[k].astype(np.float64)
    for p, outs in host.items():
        if "output" in outs:
            e = oracle.allreduce_error_ulps(f64(outs, "output"), s64, dtype_name)
            keep_max(st, {"allreduce": e})
        if "residual_out" in outs:
            e = oracle.residual_error_ulps(f64(outs, "residual_out"), s64, r64, res64, dtype_name)
            keep_max(st, {"residual": e})
        if "norm_out" in outs:
            kw = dict(weight_bias=0.0, dtype_name=dtype_name)
            e = oracle.norm_error_ulps(f64(outs, "norm_out"), s64, y64, inv64, res64, gam64, **kw)
            keep_max(st, {"norm": e})
    wants = {}  # the build's own norm output, in the call dtype, quantized by the oracle
    if 4 in host:
        wants[4] = ("static", quant_oracle.fp8_static(host[4]["norm_out"], float(sf)), None)
    if 11 in host:
        wants[11] = ("dynamic", *quant_oracle.fp8_dynamic(host[11]["norm_out"], "ieee"))
    if 9 in host:
        wants[9] = ("group", *quant_oracle.fp8_group(host[9]["norm_out"], GROUP))
    for p, outs in host.items():
        base = TWIN.get(p, p)
        if base not in wants or "quant_out" not in outs:
            continue
        kind, q_want, s_want = wants[base]
        q_want = np.asarray(q_want).view(np.uint8).reshape(m, -1)
        d = quant_oracle.code_steps(outs["quant_out"].reshape(m, -1), q_want)
        st["steps1"][kind] = st["steps1"].get(kind, 0) + int((d == 1).sum())
        st["worse"] += int((d > 1).sum())
        st["elements"] += int(d.size)
        if kind == "dynamic":
            keep_max(st, {"dyn_scale_ulps": scale_ulps(outs["scale_out"], s_want)})
        elif kind == "group":
            st["group_scale_mismatch"] += int(np.sum(outs["scale_out"][:, :m] != s_want[:, :m]))
    return st


def _merge_stats(into, st):
    from tests.gpu.harness import worst_of

    for k, v in st.items():
        if k == "steps1":
            for kind, n in v.items():
                into[k][kind] = into[k].get(kind, 0) + n
        elif k in ("worse", "group_scale_mismatch", "elements"):
            into[k] += v
        else:
            worst_of(into, {k: v})  # a NaN stays


def new_result(rank, device, torch_version, anchor_module):
    out = dict(rank=rank, device=device, torch=torch_version, anchor_module=anchor_module)
    out.update(cases=0, calls=0, diffs={}, return_mismatch=[], unwritten=dict.fromkeys(IMPLS, 0))
    return {**out, "refused": {}, "oracle": {}}


def new_stats():
    floats = "allreduce residual norm allreduce_bound residual_bound norm_own dyn_scale_ulps"
    ints = "worse group_scale_mismatch elements"
    return {i: counters(ints, floats, steps1={}) for i in IMPLS}


def _accumulation_stats(by_acc, xs, res64, gam64, dtype_name):
    """The accumulation bounds (oracle.accumulation_errors) of patterns 0 and 1 for both
    fp32_acc settings: ``by_acc[fp32_acc][pattern]`` are one build's host outputs."""
    from tests.gpu.harness import worst_of
    from tests.oracles import oracle

    st = {}
    for fp32_acc, host in by_acc.items():
        p0, p1 = host.get(0, {}), host.get(1, {})
        outs = dict(allreduce_out=p0.get("output"), residual_out=p1.get("residual_out"))
        kw = dict(fp32_acc=fp32_acc, rms_eps=RMS_EPS, dtype_name=dtype_name)
        e = oracle.accumulation_errors(xs, res64, gam64, **outs, norm_out=p1.get("norm_out"), **kw)
        worst_of(st, e)
    return st


def run_case(
    torch,
    calls,
    *,
    rank,
    device,
    dtype_name,
    xs,
    res,
    gam,
    m,
    hidden,
    oneshot,
    patterns,
    result,
    stats,
):
    """One shape case: every pattern through both builds (``calls``: "ours"/"anchor" ->
    (allreduce_fusion, workspace)), fp32_acc True then False, bytes compared; the oracles."""
    from tests.oracles import oracle

    dtype = getattr(torch, dtype_name)

    def to_dev(a):
        return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(device=device, dtype=dtype)

    x, residual, gamma = to_dev(xs[rank]), to_dev(res), to_dev(gam)
    res64, gam64 = res.astype(np.float64), gam.astype(np.float64)
    s64, r64, y64, inv64 = oracle.fused_reference(
        [a.astype(np.float64) for a in xs], res64, gam64, rms_eps=RMS_EPS, weight_bias=0.0
    )
    # A static scale that never saturates: the largest |y| maps to ~224.
    sf_val = np.float32(np.abs(y64).max() / 224.0)
    sf = torch.tensor([sf_val], dtype=torch.float32, device=device)
    label = f"{dtype_name} {m}x{hidden} {'oneshot' if oneshot else 'twoshot'}"
    host = {i: {} for i in IMPLS}
    plain = {i: {True: {}, False: {}} for i in IMPLS}  # patterns 0 and 1, both fp32_acc
    for fp32_acc in (True, False):
        for p in patterns:
            bufs = {}
            for impl in IMPLS:
                fn, ws = calls[impl]
                outs, buffers = _outputs(torch, p, m, hidden, dtype, device)
                try:
                    ok = _call(fn, ws, p, x, residual, gamma, sf, outs, oneshot, fp32_acc)
                except (ValueError, TypeError, AssertionError) as e:
                    # A host-side refusal: the same on every rank, nothing launched.
                    result["refused"].setdefault(f"{impl} p{p}", f"{label}: {e}"[:300])
                    continue
                result["calls"] += 1
                if not ok:
                    result["return_mismatch"].append(f"{impl} p{p} {label}")
                bufs[impl] = buffers
            if device != "cpu":
                torch.cuda.synchronize()
            for impl, buffers in bufs.items():
                h = _host(torch, buffers, dtype_name, m)
                result["unwritten"][impl] += sum(_unwritten(n, a, m) for n, a in h.items())
                if fp32_acc:
                    host[impl][p] = h
                if p in (0, 1):
                    plain[impl][fp32_acc][p] = h
            if len(bufs) == 2:
                for name in bufs["ours"]:
                    a, b = (_bytes(torch, bufs[impl][name]) for impl in IMPLS)
                    new = {"bytes": 0, "differing": 0, "cases": []}
                    d = result["diffs"].setdefault(f"p{p}:{name}", new)
                    n = int(np.sum(a != b))
                    d["bytes"] += int(a.size)
                    d["differing"] += n
                    if n and len(d["cases"]) < _KEEP:
                        d["cases"].append(f"{label} fp32_acc={fp32_acc}: {n}")
    ref = (s64, r64, y64, inv64, res64, gam64)
    ours_st = _oracle_stats(host["ours"], dtype_name, ref, sf_val, m)
    same = set(host["ours"]) == set(host["anchor"]) and all(
        host["ours"][p][n].tobytes() == host["anchor"][p][n].tobytes()
        for p in host["ours"]
        for n in host["ours"][p]
    )
    # Identical bytes have identical errors: the oracle runs again only when they differ.
    anc_st = ours_st if same else _oracle_stats(host["anchor"], dtype_name, ref, sf_val, m)
    xs64 = [np.asarray(x, np.float64) for x in xs]
    for impl, st in (("ours", ours_st), ("anchor", anc_st)):
        acc = _accumulation_stats(plain[impl], xs64, res64, gam64, dtype_name)
        _merge_stats(stats[impl], {**st, **acc})
    result["cases"] += 1


def sweep(torch, dist, result, make_calls, world, seed, tokens, hiddens, dtypes, patterns):
    """Per dtype, ``make_calls`` (-> run_case's ``calls``, the workspaces to free) then every
    shape case, inputs from seed + k, into result["oracle"][dtype]."""
    from tests.gpu.harness import draw_case, shape_cases

    case_no = 0
    where = dict(rank=result["rank"], device=result["device"], patterns=patterns, result=result)
    for dtype_name in dtypes:
        calls, workspaces = make_calls(getattr(torch, dtype_name))
        stats = new_stats()
        npdt = _np_dtype(dtype_name)
        for hidden, m, oneshot in shape_cases(tokens, hiddens, world):
            case_no += 1
            xs, res, gam = draw_case(seed + case_no, world, m, hidden, npdt)
            case = dict(xs=xs, res=res, gam=gam, m=m, hidden=hidden, oneshot=oneshot)
            run_case(torch, calls, **where, dtype_name=dtype_name, stats=stats, **case)
        result["oracle"][dtype_name] = stats
        dist.barrier()  # no rank frees while a peer may still read its buffers
        for ws in workspaces:
            ws.destroy()


def worker(
    rank, world, chan, *, port, seed, anchor_path, tokens, hiddens, dtypes=DTYPES, patterns=PATTERNS
):
    from tests.gpu import anchor
    from tests.gpu.workers.common import anchor_workspace
    from tests.gpu.workers.torch_workers import _gloo, _workspace

    with _gloo(rank, world, port) as (torch, dist, device, tc):
        t0 = time.monotonic()
        fi = anchor.load(anchor_path)  # raises AnchorUnavailable with the reason
        result = new_result(rank, device, torch.__version__, getattr(fi, "__file__", "?"))

        def make_calls(dtype):
            ours_ws = _workspace(tc, torch, world, rank, max(tokens), max(hiddens), dtype)
            fi_ws = anchor_workspace(fi, dist, world, rank, max(tokens), max(hiddens), dtype)
            calls = {"ours": (tc.allreduce_fusion, ours_ws), "anchor": (fi.allreduce_fusion, fi_ws)}
            return calls, (fi_ws, ours_ws)

        sweep(torch, dist, result, make_calls, world, seed, tokens, hiddens, dtypes, patterns)
        result["seconds"] = time.monotonic() - t0
        return result
