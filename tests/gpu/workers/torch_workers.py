"""Per-process bodies of the torch_compat GPU tests (tests/gpu/test_torch.py).

Each process joins torch.distributed over gloo (never NCCL: the workspace exchange is our own,
over the c10d store) and drives GPU ``wanted % torch.cuda.device_count()``: with fewer GPUs
than processes, ranks share a GPU (their kernels time-slice; the protocol still completes).
Inputs are drawn from seeds derived from (seed, group, case, member), so every member can
rebuild its whole group's inputs and the float64 oracle (tests/oracles/oracle.py).
"""

import contextlib
import hashlib
import random
import time

import numpy as np

from tests.gpu.workers.common import counters, keep_max, scale_ulps

# What vLLM does on every rank, identically: the exchange must not depend on it.
SHARED_SEED = 1234
RMS_EPS = 1e-6


@contextlib.contextmanager
def _gloo(rank, world, port, wanted_device=None):
    """(torch, dist, device, torch_compat): this process in a gloo group on GPU ``wanted_device``
    (default ``rank``) modulo the GPUs there are; the process group is destroyed on leaving."""
    from tests.gpu.workers.common import init_gloo, no_multicast_defaults

    no_multicast_defaults()  # inherited from tests/conftest.py under pytest, not by hand
    import torch

    device = (rank if wanted_device is None else wanted_device) % torch.cuda.device_count()
    # The workspace takes torch.cuda.current_device(), which init_gloo sets.
    torch, dist = init_gloo(rank, world, port, device)
    import torch_compat as tc

    try:
        yield torch, dist, device, tc
    finally:
        dist.destroy_process_group()


def _workspace(tc, torch, world, rank, max_tokens, hidden, dtype=None, **kw):
    """A torch_compat workspace (bf16 unless ``dtype``) of the whole world, 120 s to create."""
    dtype = torch.bfloat16 if dtype is None else dtype
    return tc.create_allreduce_fusion_workspace(
        "trtllm", world, rank, max_tokens, hidden, dtype, timeout_s=120, **kw
    )


def drawn_case(torch, seed, world, m, hidden, dt, *, wb=0.0):
    """harness.draw_case as CPU tensors of ``dt``, their float64 values and the group's oracle:
    (xs_t, res_t, gam_t, xs64, res64, gam64, ref)."""
    from tests.gpu.harness import draw_case

    xs, res, gam = draw_case(seed, world, m, hidden)
    xs_t = [to_torch(torch, a, dt, "cpu") for a in xs]
    res_t, gam_t = to_torch(torch, res, dt, "cpu"), to_torch(torch, gam, dt, "cpu")
    xs64 = [t.double().numpy() for t in xs_t]
    res64, gam64 = res_t.double().numpy(), gam_t.double().numpy()
    return xs_t, res_t, gam_t, xs64, res64, gam64, group_oracle(xs64, res64, gam64, wb=wb)


def _group_inputs(seed, group, case, m, hidden, world, torch):
    """bf16 inputs of every member of ``group`` for one case, plus the group's residual and
    gamma (the same on every member, as a replicated residual stream is in TP)."""

    def draw(*shape, member):
        rng = np.random.default_rng([seed, group, case, member])
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).bfloat16()

    xs = [draw(m, hidden, member=r) for r in range(world)]
    residual = draw(m, hidden, member=world)
    rng = np.random.default_rng([seed, group, case, world + 1])
    gamma = torch.from_numpy(rng.uniform(-2.0, 2.0, hidden).astype(np.float32)).bfloat16()
    return xs, residual, gamma


def _new_tally():
    return {"worst": {"residual": 0.0, "norm": 0.0}, "nan_outputs": 0}


class _Pattern1Case:
    """One pattern-1 call on this member's device, checked against the float64 oracle."""

    def __init__(self, torch, device, tp_rank, xs, residual, gamma):
        self.torch = torch
        f32 = lambda t: t.float().numpy()
        self.host = ([f32(t) for t in xs], f32(residual), f32(gamma))
        self.x = xs[tp_rank].to(device)
        self.res_in, self.gamma_d = residual.to(device), gamma.to(device)
        self.res_out, self.norm_out = torch.empty_like(self.x), torch.empty_like(self.x)

    def run(self, ws, tally, **kw):
        """Poisons the outputs, calls, waits; adds the residual and norm ulps and the NaN
        count to ``tally`` (_new_tally's); returns the digest of both outputs."""
        import torch_compat as tc
        from tests.gpu.workers.common import plain_ulps

        torch = self.torch
        self.res_out.fill_(float("nan"))
        self.norm_out.fill_(float("nan"))
        outs = dict(residual_out=self.res_out, norm_out=self.norm_out)
        ins = dict(residual_in=self.res_in, rms_gamma=self.gamma_d, rms_eps=RMS_EPS)
        pattern = tc.AllReduceFusionPattern.kARResidualRMSNorm
        ret = tc.allreduce_fusion(self.x, ws, pattern, **outs, **ins, **kw)
        assert ret is self.norm_out, "pattern 1 must return norm_out (FlashInfer's rule)"
        torch.cuda.synchronize()
        r, y = (t.float().cpu().numpy() for t in (self.res_out, self.norm_out))
        e = plain_ulps(*self.host, "bfloat16", residual_out=r, norm_out=y)
        keep_max(tally["worst"], {"residual": e["residual"], "norm": e["norm"]})
        tally["nan_outputs"] += int(np.isnan(r).sum() + np.isnan(y).sum())
        digest = hashlib.sha256()
        for t in (self.res_out, self.norm_out):
            digest.update(t.cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


# DP=2 x TP=2 on two GPUs with group B crossed, as in vLLM's DP+TP bug reports: group A =
# {global 0 on GPU 0, global 1 on GPU 1}; group B = {global 2 on GPU 1 as TP rank 0,
# global 3 on GPU 0 as TP rank 1}.
DP_TP_GROUPS = ([0, 1], [2, 3])
DP_TP_DEVICES = (0, 1, 1, 0)


def dp_tp_worker(rank, world, chan, *, port, seed, tokens, hidden):
    with _gloo(rank, world, port, DP_TP_DEVICES[rank]) as (torch, dist, device, tc):
        groups = [dist.new_group(g) for g in DP_TP_GROUPS]  # every process, same order
        g, tp_rank = rank // 2, rank % 2
        random.seed(SHARED_SEED)
        np.random.seed(SHARED_SEED)
        torch.manual_seed(SHARED_SEED)
        ws = _workspace(tc, torch, 2, tp_rank, max(tokens), hidden, group=groups[g])
        placement = {"rank": rank, "group": g, "tp_rank": ws.rank, "device": ws.device}
        placement["global_ranks"] = list(ws.global_ranks)
        placement["member_devices"] = [m.device for m in ws.members]
        placement["gpus"] = torch.cuda.device_count()
        dist.barrier()  # both groups start together, so their calls overlap
        tally, digests, cases = _new_tally(), [], []
        for i, m in enumerate(tokens):
            xs, residual, gamma = _group_inputs(seed, g, i, m, hidden, 2, torch)
            case = _Pattern1Case(torch, device, tp_rank, xs, residual, gamma)
            # The heuristic's choice, and two-shot wherever it can run (more tokens than ranks).
            for use_oneshot in (None, False) if m > 2 else (None,):
                kw = dict(use_oneshot=use_oneshot, launch_with_pdl=True, fp32_acc=True)
                digests.append(case.run(ws, tally, **kw))
                cases.append((m, use_oneshot))
        dist.barrier(group=groups[g])  # no member frees while its peer may still launch
        ws.destroy()
        return {**placement, **tally, "digests": digests, "cases": cases}


def cycles_worker(rank, world, chan, *, port, seed, cycles, tokens, hidden):
    """``cycles`` x (create, one checked pattern-1 call, destroy), with the device's free
    memory before the first and after the last. Destroy is local, as FlashInfer's is: no
    barrier between the call and the destroy."""
    with _gloo(rank, world, port) as (torch, dist, device, tc):
        xs, residual, gamma = _group_inputs(seed, 0, 0, tokens, hidden, world, torch)
        case = _Pattern1Case(torch, device, rank, xs, residual, gamma)
        tally, reprs = _new_tally(), []

        def cycle():
            ws = _workspace(tc, torch, world, rank, tokens, hidden)
            if not reprs:
                reprs.append(repr(ws))
            case.run(ws, tally)
            ws.destroy()

        def free_bytes():
            """The device's free memory once every rank has finished and released its
            allocator's cache: ranks may share a GPU, and free memory is device-wide."""
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            dist.barrier()
            free = torch.cuda.mem_get_info(device)[0]
            dist.barrier()
            return free

        cycle()  # warm-up: CUDA context, lazy kernel loading, allocator pools
        before = free_bytes()
        t0 = time.monotonic()
        for _ in range(cycles):
            cycle()
        seconds = time.monotonic() - t0
        after = free_bytes()
        out = {"rank": rank, "device": device, "cycles": cycles, "seconds": seconds}
        return {**out, "free_before": before, "free_after": after, **tally, "repr": reprs[0]}


def never_join_worker(rank, world, chan, *, port, create_timeout_s):
    """Rank 1 never creates its workspace; rank 0 must get a TimeoutError naming it."""
    with _gloo(rank, world, port) as (torch, dist, device, tc):
        if rank == 1:
            chan.barrier("attempted")  # just waits until rank 0 gave up, then exits
            return {"rank": 1}
        t0 = time.monotonic()
        try:
            tc.create_allreduce_fusion_workspace(
                "trtllm", 2, 0, 16, 4096, torch.bfloat16, timeout_s=create_timeout_s
            )
            error_type, message = None, "created"
        except Exception as e:
            error_type, message = type(e).__name__, str(e)
        elapsed = time.monotonic() - t0
        chan.barrier("attempted")
        return {"rank": 0, "error_type": error_type, "message": message, "seconds": elapsed}


# --- Patterns 0/1 parity sweep, FP8 patterns, torch.compile, CUDA graphs, the fusion pass. The
# tensor plumbing (new_outputs / call_pattern / outputs_to_numpy) and the checks (plain_errors /
# quant_stats) are shared with parity_jax_torch.py and run on CPU with a simulated kernel by
# tests/torch/test_worker_plumbing.py.

FP8_PATTERNS = (2, 4, 10, 11, 8, 9)  # twins: (2, 4), (10, 11), (8, 9)
GROUP = 128


def _traits(pattern):
    from jax_fusedar.common.patterns import TRAITS, AllReduceFusionPattern

    return TRAITS[AllReduceFusionPattern(pattern)]


def to_torch(torch, a, dtype, device):
    """float32 numpy -> torch ``dtype`` on ``device`` (round to nearest even, as numpy/JAX)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(dtype).to(device)


def new_outputs(torch, pattern, m, hidden, dtype, device, group=GROUP):
    """Poisoned outputs of ``pattern`` (NaN; 0xFF bytes in quant_out and the group scales);
    ``_scale_buf`` is the dense (K, T) buffer behind the per-token-group scale view."""
    from jax_fusedar.common import quant_layouts

    t = _traits(pattern)
    full = lambda shape, dt=dtype, v=float("nan"): torch.full(shape, v, dtype=dt, device=device)
    plain = {"output": t.has_allreduce_out, "residual_out": t.has_residual}
    out = {k: full((m, hidden)) for k, on in {**plain, "norm_out": t.has_norm_out}.items() if on}
    if t.quant is not None:
        assert t.quant != "fp4", "NVFP4 is not run on sm90"
        q = torch.empty((m, hidden), dtype=torch.float8_e4m3fn, device=device)
        q.view(torch.uint8).fill_(0xFF)
        out["quant_out"] = q
    if t.quant == "dynamic_fp8":
        out["scale_out"] = full((m, 1), torch.float32)
    if t.quant == "group_fp8":
        k, tt = quant_layouts.group_scale_buffer_shape(m, hidden, group)
        buf = full((k, tt), torch.int32, -1)
        out["_scale_buf"] = buf
        out["scale_out"] = buf[:, :m].t()  # FlashInfer's (M, K) tensor, strides (1, T)
    return out


def call_pattern(
    tc,
    ws,
    pattern,
    x,
    res,
    gam,
    outs,
    *,
    sf=None,
    group=GROUP,
    oneshot=None,
    fp32_acc=True,
    wb=0.0,
    pdl=True,
):
    """One torch_compat.allreduce_fusion call of ``pattern`` into ``outs``; checks the
    returned tensor is FlashInfer's (norm_out, else quant_out, else output)."""
    t = _traits(pattern)
    kw = {k: v for k, v in outs.items() if not k.startswith("_")}
    if t.has_residual:
        kw.update(residual_in=res, rms_gamma=gam, rms_eps=RMS_EPS, weight_bias=wb)
    if t.uses_scale_factor:
        kw["scale_factor"] = sf
    if t.quant == "group_fp8":
        kw["block_quant_group_size"] = group
    ret = tc.allreduce_fusion(
        x, ws, pattern, launch_with_pdl=pdl, use_oneshot=oneshot, fp32_acc=fp32_acc, **kw
    )
    want = outs.get("norm_out", outs.get("quant_out", outs.get("output")))
    assert ret is want, f"pattern {pattern} returned the wrong tensor"
    return ret


def outputs_to_numpy(torch, outs):
    """Host copies: floats as float64 plus raw bytes (``<name>_bytes``), quant_out as uint8,
    dynamic scales as float32 [M, 1], group scales as the dense int32 (K, T) buffer."""
    got = {}
    for k, v in outs.items():
        if k == "scale_out" and "_scale_buf" in outs:
            continue
        if k == "_scale_buf":
            got["scale_out"] = v.cpu().numpy()
        elif k == "quant_out":
            got[k] = v.view(torch.uint8).cpu().numpy()
        elif k == "scale_out":
            got[k] = v.cpu().numpy()
        else:
            got[k] = v.float().cpu().numpy().astype(np.float64)
            got[k + "_bytes"] = v.contiguous().view(torch.uint8).cpu().numpy()
    return got


def group_oracle(xs, res, gam, *, wb=0.0):
    """float64 oracle tuple (s, r, y, inv) of the group's inputs (numpy, any float dtype)."""
    from tests.oracles import oracle

    f64 = lambda a: np.asarray(a, np.float64)
    xs64 = [f64(x) for x in xs]
    return oracle.fused_reference(xs64, f64(res), f64(gam), rms_eps=RMS_EPS, weight_bias=wb)


# oracle.accumulation_errors's keywords -> the outputs' names here (FlashInfer's)
ACCUMULATED = {"allreduce_out": "output", "residual_out": "residual_out", "norm_out": "norm_out"}


def plain_errors(got, ref, res, gam, dtype, wb, *, xs=None, fp32_acc=True):
    """ulps of whatever float outputs ``got`` holds, the NaN count, and given every rank's
    ``xs`` the accumulation measures of any world size (oracle.accumulation_errors)."""
    from tests.oracles import oracle

    s64, r64, y64, inv64 = ref
    e = {"nans": 0}
    if xs is not None:
        outs = {k: got.get(name) for k, name in ACCUMULATED.items()}
        kw = dict(fp32_acc=fp32_acc, rms_eps=RMS_EPS, weight_bias=wb, dtype_name=dtype)
        e.update(oracle.accumulation_errors(xs, res, gam, **outs, **kw))
    if "output" in got:
        e["allreduce"] = oracle.allreduce_error_ulps(got["output"], s64, dtype)
    if "residual_out" in got:
        e["residual"] = oracle.residual_error_ulps(got["residual_out"], s64, r64, res, dtype)
    if "norm_out" in got:
        e["norm"] = oracle.norm_error_ulps(
            got["norm_out"], s64, y64, inv64, res, gam, weight_bias=wb, dtype_name=dtype
        )
    for k in ("output", "residual_out", "norm_out"):
        e["nans"] += int(np.isnan(got[k]).sum()) if k in got else 0
    return e


def new_quant_stats():
    steps1 = {"static": 0, "dynamic": 0, "group": 0}
    ints = "cases elements worse group_scale_mismatch poisoned"
    return counters(ints, "dyn_scale_ulps residual norm", steps1=steps1, twin_diffs=[])


def quant_stats(stats, by_pattern, ref, res, gam, dtype, sf, group, label, xs=None):
    """Adds the FP8 checks of one case (``by_pattern``: {2, 4, 10, 11, 8, 9: outputs_to_numpy})
    to ``stats``: the Out patterns' codes against quant_oracle on their own norm_out, each twin
    against its Out twin, scales against the oracle, residual/norm against float64."""
    from tests.gpu.harness import worst_of
    from tests.oracles import quant_oracle

    o = by_pattern
    m = o[4]["norm_out"].shape[0]
    for p in FP8_PATTERNS:
        e = plain_errors(o[p], ref, res, gam, dtype, 0.0, xs=xs)
        worst_of(stats, {k: v for k, v in e.items() if k != "nans"})
        q = o[p]["quant_out"]
        stats["poisoned"] += e["nans"] + int(np.sum((q & 0x7F) == 0x7F))
    for p in (10, 11):
        stats["poisoned"] += int(np.isnan(o[p]["scale_out"]).sum())
    for p in (8, 9):
        stats["poisoned"] += int(np.sum(o[p]["scale_out"][:, :m].view(np.uint8) == 0xFF))
    for name, a, b in (
        ("static q", o[2]["quant_out"], o[4]["quant_out"]),
        ("dynamic q", o[10]["quant_out"], o[11]["quant_out"]),
        ("dynamic scale", o[10]["scale_out"], o[11]["scale_out"]),
        ("group q", o[8]["quant_out"], o[9]["quant_out"]),
        ("group scale", o[8]["scale_out"][:, :m], o[9]["scale_out"][:, :m]),
    ):
        diff = int(np.sum(a.view(np.uint8) != b.view(np.uint8)))
        if diff:
            stats["twin_diffs"].append([name, label, diff])
    want4 = quant_oracle.fp8_static(o[4]["norm_out"], float(sf))
    want11, ws11 = quant_oracle.fp8_dynamic(o[11]["norm_out"], "ieee")
    want9, wb9 = quant_oracle.fp8_group(o[9]["norm_out"], group)
    for kind, p, want in (("static", 4, want4), ("dynamic", 11, want11), ("group", 9, want9)):
        d = quant_oracle.code_steps(o[p]["quant_out"], np.asarray(want).view(np.uint8))
        stats["steps1"][kind] += int((d == 1).sum())
        stats["worse"] += int((d > 1).sum())
    keep_max(stats, {"dyn_scale_ulps": scale_ulps(o[11]["scale_out"], ws11)})
    stats["group_scale_mismatch"] += int(np.sum(o[9]["scale_out"][:, :m] != wb9[:, :m]))
    stats["elements"] += o[4]["quant_out"].size
    stats["cases"] += 1
    return stats


def static_scale(ref):
    """A static FP8 dequantization scale that never saturates: max |y| maps to ~224."""
    return np.float32(np.abs(ref[2]).max() / 224.0)


def _torch_dtype(torch, name):
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _on_device(drawn, rank, device):
    """This rank's x, the residual and gamma of a drawn_case on ``device``."""
    xs_t, res_t, gam_t = drawn[:3]
    return xs_t[rank].to(device), res_t.to(device), gam_t.to(device)


def parity_worker(rank, world, chan, *, port, seed, tokens, hiddens, dtypes):
    """Patterns 0 and 1 over tokens x hiddens x dtypes, one- and two-shot, against the
    float64 oracle; every rank's outputs must agree bit for bit (digest)."""
    from tests.gpu.harness import shape_cases, worst_of

    with _gloo(rank, world, port) as (torch, dist, device, tc):
        ws = _workspace(tc, torch, world, rank, max(tokens), max(hiddens))
        worst = {d: counters("cases", "allreduce residual norm") for d in dtypes}
        nans, digest = 0, hashlib.sha256()
        cases = [(d, *c) for d in dtypes for c in shape_cases(tokens, hiddens, world)]
        for i, (dtype, hidden, m, oneshot) in enumerate(cases):
            dt = _torch_dtype(torch, dtype)
            wb, acc = float(i % 2), i % 3 != 2
            drawn = drawn_case(torch, seed * 1000 + i, world, m, hidden, dt, wb=wb)
            x, r_d, g_d = _on_device(drawn, rank, device)
            got, opts = {}, dict(oneshot=oneshot, fp32_acc=acc, wb=wb, pdl=bool(i % 2))
            for p in (0, 1):
                outs = new_outputs(torch, p, m, hidden, dt, device)
                call_pattern(tc, ws, p, x, r_d, g_d, outs, **opts)
                torch.cuda.synchronize()
                got.update(outputs_to_numpy(torch, outs))
            _, _, _, xs64, res_np, gam_np, ref = drawn
            e = plain_errors(got, ref, res_np, gam_np, dtype, wb, xs=xs64, fp32_acc=acc)
            worst_of(worst[dtype], {k: v for k, v in e.items() if k != "nans"})
            worst[dtype]["cases"] += 1
            nans += e["nans"]
            for k in ("output_bytes", "residual_out_bytes", "norm_out_bytes"):
                digest.update(got[k].tobytes())
        dist.barrier()
        ws.destroy()
        out = {"rank": rank, "worst": worst, "nans": nans}
        return {**out, "digest": digest.hexdigest(), "cases": cases}


def fp8_worker(rank, world, chan, *, port, seed, shapes, dtypes):
    """The FP8 patterns through torch_compat.allreduce_fusion (quant_stats); ``shapes``:
    (hidden, tokens, use_oneshot) list."""
    with _gloo(rank, world, port) as (torch, dist, device, tc):
        max_elems = max(h * m for h, m, _ in shapes)
        hmax = max(h for h, _, _ in shapes)
        ws = _workspace(tc, torch, world, rank, -(-max_elems // hmax), hmax)
        stats = new_quant_stats()
        # NVFP4 on this GPU: refused before any launch (sm90), or run (sm100+).
        cc = torch.cuda.get_device_capability(device)
        stats["capability"] = list(cc)
        cases = [(dtype, *shape) for dtype in dtypes for shape in shapes]
        for i, (dtype, hidden, m, oneshot) in enumerate(cases, 1):
            dt = _torch_dtype(torch, dtype)
            drawn = drawn_case(torch, seed * 1000 + i, world, m, hidden, dt)
            _, _, _, xs64, res_np, gam_np, ref = drawn
            sf = static_scale(ref)
            sf_d = torch.tensor([sf], dtype=torch.float32, device=device)
            x, r_d, g_d = _on_device(drawn, rank, device)
            by_p = {}
            for p in FP8_PATTERNS:
                outs = new_outputs(torch, p, m, hidden, dt, device)
                call_pattern(tc, ws, p, x, r_d, g_d, outs, sf=sf_d, oneshot=oneshot)
                torch.cuda.synchronize()
                by_p[p] = outputs_to_numpy(torch, outs)
            label = f"{dtype} {m}x{hidden} {'one' if oneshot else 'two'}-shot"
            quant_stats(stats, by_p, ref, res_np, gam_np, dtype, sf, GROUP, label, xs=xs64)
        try:
            x = torch.randn(16, 1024, device=device).bfloat16()
            outs = {"residual_out": torch.empty_like(x), "norm_out": torch.empty_like(x)}
            outs["quant_out"] = torch.empty(16, 512, dtype=torch.uint8, device=device)
            outs["scale_out"] = torch.empty(128, 64, dtype=torch.uint8, device=device)
            if cc[0] >= 10:
                stats["nvfp4_refused"] = "sm100+: not refused (not run here)"
            else:
                one = torch.ones(1, device=device)
                ins = dict(residual_in=x, rms_gamma=x[0].clone(), scale_factor=one)
                tc.allreduce_fusion(x, ws, 5, **ins, **outs)
                stats["nvfp4_refused"] = "no error"
        except ValueError as e:
            stats["nvfp4_refused"] = str(e)[:200]
        dist.barrier()
        ws.destroy()
        return {"rank": rank, "quant": stats}


def compile_worker(rank, world, chan, *, port, seed, m, hidden, backend):
    """The custom ops (patterns 0, 1, 11, 9) under torch.compile(fullgraph=True): the same bits
    as eager, and within the oracle bounds."""
    with _gloo(rank, world, port) as (torch, dist, device, tc):
        from torch_compat import library

        ws = _workspace(tc, torch, world, rank, m, hidden)
        h = library.register_workspace(ws)
        AR, FUSED = library.ALLREDUCE, library.ALLREDUCE_RESIDUAL_RMSNORM
        QUANT = library.ALLREDUCE_RESIDUAL_RMSNORM_QUANT

        def f(x, res, g):
            a = AR(x, None, True, h)
            r, n = FUSED(x, res, g, RMS_EPS, 0.0, None, True, h)
            r11, n11, q11, s11 = QUANT(x, res, g, RMS_EPS, 0.0, 11, None, None, None, None, True, h)
            r9, n9, q9, s9 = QUANT(x, res, g, RMS_EPS, 0.0, 9, None, GROUP, None, None, True, h)
            return a, r, n, r11, n11, q11, s11, r9, n9, q9, s9

        drawn = drawn_case(torch, seed, world, m, hidden, torch.bfloat16)
        _, _, _, xs64, res64, gam64, ref = drawn
        args = _on_device(drawn, rank, device)
        eager = f(*args)
        torch.cuda.synchronize()
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend=backend)
        got = compiled(*args)
        torch.cuda.synchronize()
        # f's outputs: the plain three, then (r, n, q, s) of patterns 11 and 9
        quant = tuple(k + p for p in ("11", "9") for k in "rnqs")  # r11, n11, ..., s9
        names = ("allreduce", "residual_out", "norm_out", *quant)
        differing = {}
        for name, a, b in zip(names, eager, got):
            meta_a, meta_b = (f"{tuple(t.shape)} {t.dtype} {t.stride()}" for t in (a, b))
            if (a.shape, a.dtype, a.stride()) != (b.shape, b.dtype, b.stride()):
                differing[name] = f"metadata {meta_a} vs {meta_b}"
                continue
            if name == "s9":  # only the written (M, K) view
                a, b = a.contiguous(), b.contiguous()
            ab = a.contiguous().view(torch.uint8) if a.element_size() else a
            bb = b.contiguous().view(torch.uint8) if b.element_size() else b
            n = int((ab != bb).sum())
            if n:
                differing[name] = n
        plain = zip(("output", "residual_out", "norm_out"), got[:3])
        host = {k: t.float().cpu().double().numpy() for k, t in plain}
        e = plain_errors(host, ref, res64, gam64, "bfloat16", 0.0, xs=xs64)
        dist.barrier()
        library.unregister_workspace(h)
        ws.destroy()
        out = {"rank": rank, "backend": backend, "differing": differing, "errors": e}
        return {**out, "torch": torch.__version__}


def cuda_graph_worker(rank, world, chan, *, port, seed, m, hidden, replays):
    """Patterns 1 and 11 each captured in a CUDAGraph and replayed ``replays`` times on fresh
    inputs copied into the static buffers, every replay against the oracles."""
    with _gloo(rank, world, port) as (torch, dist, device, tc):
        from tests.gpu.harness import draw_case, worst_of
        from tests.oracles import quant_oracle

        ws = _workspace(tc, torch, world, rank, m, hidden)
        dt = torch.bfloat16
        x = torch.zeros(m, hidden, dtype=dt, device=device)
        res = torch.zeros_like(x)
        gam = torch.zeros(hidden, dtype=dt, device=device)
        results = {}
        for p, pdl in ((1, False), (11, True)):
            outs = new_outputs(torch, p, m, hidden, dt, device)
            # Warm-up outside the capture with real data (collective: both ranks).
            xs, r0, g0 = draw_case(seed * 1000 + p, world, m, hidden)
            for t, a in ((x, xs[rank]), (res, r0), (gam, g0)):
                t.copy_(to_torch(torch, a, dt, device))
            call_pattern(tc, ws, p, x, res, gam, outs, oneshot=None, pdl=pdl)
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            launches0 = _native_launches()
            with torch.cuda.graph(graph):
                call_pattern(tc, ws, p, x, res, gam, outs, oneshot=None, pdl=pdl)
            captured_launches = _native_launches() - launches0
            torch.cuda.synchronize()
            dist.barrier()
            ints = "nans replays code_steps1 code_worse poisoned"
            worst = counters(ints, "residual norm scale_ulps")
            launches1 = _native_launches()
            for i in range(replays):
                drawn = drawn_case(torch, seed * 1000 + 100 + i + 1000 * p, world, m, hidden, dt)
                xs_t, r_t, g_t, xs64, r64, g64, ref = drawn
                for t, a in ((x, xs_t[rank]), (res, r_t), (gam, g_t)):
                    t.copy_(a.to(device))
                for k, v in outs.items():  # poison before every replay
                    if k in ("residual_out", "norm_out") or (k == "scale_out" and p == 11):
                        v.fill_(float("nan"))
                    elif k == "quant_out":
                        v.view(torch.uint8).fill_(0xFF)
                graph.replay()
                torch.cuda.synchronize()
                got = outputs_to_numpy(torch, outs)
                e = plain_errors(got, ref, r64, g64, "bfloat16", 0.0, xs=xs64)
                worst_of(worst, {k: v for k, v in e.items() if k != "nans"})
                worst["nans"] += e["nans"]
                if p == 11:
                    wq, wsc = quant_oracle.fp8_dynamic(got["norm_out"], "ieee")
                    d = quant_oracle.code_steps(got["quant_out"], np.asarray(wq).view(np.uint8))
                    worst["code_steps1"] += int((d == 1).sum())
                    worst["code_worse"] += int((d > 1).sum())
                    keep_max(worst, {"scale_ulps": scale_ulps(got["scale_out"], wsc)})
                    worst["poisoned"] += int(np.sum((got["quant_out"] & 0x7F) == 0x7F))
                worst["replays"] += 1
            worst["host_launches_during_replays"] = _native_launches() - launches1
            worst["launches_captured"] = captured_launches
            worst["elements"] = m * hidden * replays
            results[f"pattern{p}"] = worst
            del graph
        dist.barrier()
        ws.destroy()
        return {"rank": rank, "m": m, "hidden": hidden, "results": results}


def _native_launches():
    from jax_fusedar.common import native

    return native.require().launch_count()


def rms_manual(x, g, eps=RMS_EPS):
    """vLLM's RMSNorm.forward_native: rounds before the gamma multiply, so the fusion pass
    fuses it only with allow_rounding_change=True."""
    import torch

    xf = x.to(torch.float32)
    v = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(v + eps)).to(x.dtype) * g


def build_tp_model(torch, group, rank, world, *, m, hidden, layers, seed, device, norm):
    """(model, args, (norm64, residual64)): ``layers`` TP blocks (row-parallel matmul ->
    funcol.all_reduce -> + residual -> RMSNorm ``norm``), this rank's shards, the float64 model."""
    import torch.nn.functional as F
    from torch.distributed import _functional_collectives as funcol

    rng = np.random.default_rng(seed)  # the same weights on every rank
    dt = torch.bfloat16
    shard = hidden // world
    x_full = rng.standard_normal((m, hidden), dtype=np.float32)
    res0 = rng.standard_normal((m, hidden), dtype=np.float32)
    w_full = [rng.standard_normal((hidden, hidden), dtype=np.float32) for _ in range(layers)]
    w_full = [w / np.sqrt(hidden) for w in w_full]
    gammas = [rng.uniform(0.5, 1.5, hidden).astype(np.float32) for _ in range(layers)]
    lo, hi = rank * shard, (rank + 1) * shard
    t = lambda a: to_torch(torch, a, dt, device)
    args = (t(x_full[:, lo:hi]), t(res0), *[t(w[lo:hi]) for w in w_full], *[t(g) for g in gammas])
    f_rms_norm = lambda r, g: F.rms_norm(r, (hidden,), g, RMS_EPS)
    norm_fn = rms_manual if norm == "manual" else f_rms_norm

    def model(x_shard, residual, *wg):
        w_sh, gs = wg[:layers], wg[layers:]
        h = x_shard
        for i in range(layers):
            partial = h @ w_sh[i]  # row-parallel: [m, H/tp] @ [H/tp, H]
            s = funcol.all_reduce(partial, "sum", group)
            residual = s + residual
            normed = norm_fn(residual, gs[i])
            h = normed[:, lo:hi]  # this rank's input shard of the next layer
        return normed, residual

    def f64(a):
        return to_torch(torch, a, dt, "cpu").double().numpy()

    h64, r64 = f64(x_full), f64(res0)
    for i in range(layers):
        r64 = h64 @ f64(w_full[i]) + r64
        h64 = r64 / np.sqrt(np.mean(r64 * r64, axis=-1, keepdims=True) + RMS_EPS) * f64(gammas[i])
    return model, args, (h64, r64)


def trace_tp_model(torch, model, args):
    """make_fx with fake tensors; F.rms_norm's CUDA path (aten._fused_rms_norm) decomposed
    into the primitive form the pass matches."""
    from torch.fx.experimental.proxy_tensor import make_fx

    decomp = {}
    if hasattr(torch.ops.aten, "_fused_rms_norm"):
        from torch._decomp import get_decompositions

        decomp = get_decompositions([torch.ops.aten._fused_rms_norm])
    return make_fx(model, decomposition_table=decomp, tracing_mode="fake")(*args)


def compare_models(torch, fused, unfused, ref64):
    def rel(out, ref):
        return float(np.max(np.abs(out.float().cpu().double().numpy() - ref)) / np.max(np.abs(ref)))

    pairs = zip(fused, unfused)
    return {
        "finite": bool(all(bool(torch.isfinite(a).all()) for a in (*fused, *unfused))),
        "fused_vs_unfused": max(
            float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in pairs
        ),
        "fused_vs_f64": max(rel(fused[0], ref64[0]), rel(fused[1], ref64[1])),
        "unfused_vs_f64": max(rel(unfused[0], ref64[0]), rel(unfused[1], ref64[1])),
    }


def count_targets(gm, target):
    return sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


def fusion_pass_worker(rank, world, chan, *, port, seed, m, hidden, layers, mode):
    """build_tp_model over NCCL (the unfused baseline). "make_fx": per norm form, trace, run,
    fuse_allreduce_rmsnorm, run; "inductor": torch.compile with the pass as post-grad pass."""
    with _gloo(rank, world, port) as (torch, dist, device, tc):
        from torch_compat import fusion_pass, library

        nccl = dist.new_group(list(range(world)), backend="nccl")
        ws = _workspace(tc, torch, world, rank, m, hidden)
        ar = torch.ops._c10d_functional.all_reduce.default
        out = {"rank": rank, "mode": mode, "forms": {}}
        for norm in ("manual", "F.rms_norm") if mode == "make_fx" else ("F.rms_norm",):
            shape = dict(m=m, hidden=hidden, layers=layers, seed=seed, device=device)
            model, args, ref64 = build_tp_model(torch, nccl, rank, world, norm=norm, **shape)
            r = {}
            if mode == "make_fx":
                gm = trace_tp_model(torch, model, args)
                r["all_reduces_before"] = count_targets(gm, ar)
                unfused = gm(*args)
                torch.cuda.synchronize()
                r["replaced"] = tc.fuse_allreduce_rmsnorm(
                    gm, ws, allow_rounding_change=norm == "manual"
                )
                r["fused_ops"] = count_targets(gm, library.ALLREDUCE_RESIDUAL_RMSNORM)
                r["all_reduces_after"] = count_targets(gm, ar)
                if r["replaced"] == 0:
                    r["graph"] = gm.code[:3000]
                fused = gm(*args)
                torch.cuda.synchronize()
            else:
                torch._dynamo.reset()
                unfused = torch.compile(model, fullgraph=True)(*args)
                torch.cuda.synchronize()
                torch._dynamo.reset()
                p = fusion_pass.AllReduceFusionPass(ws)
                with torch._inductor.config.patch(
                    post_grad_custom_pre_pass=p, fx_graph_cache=False, force_disable_caches=True
                ):
                    fused = torch.compile(model, fullgraph=True)(*args)
                torch.cuda.synchronize()
                torch._dynamo.reset()
                r["replaced"] = p.count
            r.update(compare_models(torch, fused, unfused, ref64))
            out["forms"][norm] = r
        dist.barrier()
        ws.destroy()
        return out
