"""The MoE patterns (6, 7) on 2 ranks (``--world`` 4 or 8 for more), in three stages that write
JSON reports to --out; rank r on GPU r % G (ranks sharing GPUs run correctness only: the benches
need a GPU per rank and say so in the report).

1. torch (a process per rank): torch_compat against the float64 oracle (tests/oracles/
   moe_oracle.py) and FlashInfer's own build (the anchor) byte for byte, the custom op captured
   in a CUDA graph and replayed on fresh inputs, and the bench: fused vs the anchor vs the
   unfused torch sequence (gather + weighted sum + NCCL all_reduce + add + RMSNorm), each as
   CUDA-graph replays timed with CUDA events;
2. JAX (a `jax.distributed` process per rank, as TP serving runs): the same cases through
   jax_fusedar's MoE ops, bitwise against stage 1's outputs, and the bench: fused vs the unfused
   XLA sequence (with psum), chains of dependent calls in one jit;
3. the anchor alone at hidden 2880 (a partial warp per token, refused by jax_fusedar and
   torch_compat) against the oracle, to show why.

    python -m tests.gpu.workers.moe_gpu --out DIR [--anchor PATH] [--stages torch,jax,anchor2880]
        [--world N]

MOE_GPU_TORCH_TIMEOUT_S and MOE_GPU_JAX_TIMEOUT_S bound stages 1 and 2 (their ranks are killed
after it); MOE_GPU_BENCH_TOKENS narrows the benches; MOE_GPU_BENCH_ON_SHARED_GPU=1 runs stage 1's
fused and anchor loops on a shared GPU (to see that they finish); MOE_GPU_CASES_ONLY=1 skips
stage 1's CUDA-graph check and bench.
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from tests.gpu.workers.common import jax_workspace, jit_shard_map, no_multicast_defaults

no_multicast_defaults()

EPS = 1e-6
# The ranks; --world sets it in the environment, so the spawned rank processes (which import
# this module afresh) see the same.
WORLD_ENV_VAR = "MOE_GPU_WORLD"
WORLD = int(os.environ.get(WORLD_ENV_VAR, "2"))
MAX_TOKENS = 1024
BACK_TO_BACK_CALLS = 64
# FlashInfer's own finalize kernel (the anchor) has the peer-buffer race our build fixes
# (docs/moe.md), which hung our unfixed build graph-timed at 1024 tokens (2 x H200 and one H200).
ANCHOR_BENCH_MAX_TOKENS = 128
HIDDEN_WS = 7168
# (pattern, dtype, tokens, hidden, top_k or experts, experts, scale, shared, routed)
CASES = [
    (7, "bfloat16", 1, 7168, 8, 256, True, True, 1.0),
    (7, "bfloat16", 16, 7168, 8, 256, True, False, 2.5),
    (7, "bfloat16", 128, 7168, 8, 256, True, True, 1.0),
    (7, "bfloat16", 1024, 7168, 8, 256, True, True, 1.0),
    (7, "float16", 16, 4096, 4, 64, True, True, 1.0),
    (7, "bfloat16", 64, 4096, 2, 8, False, False, 1.0),
    (7, "float16", 5, 7168, 1, 16, True, True, 1.0),
    (6, "bfloat16", 16, 7168, 8, 8, None, None, None),
    (6, "float16", 128, 4096, 4, 4, None, None, None),
    (6, "bfloat16", 1, 7168, 1, 1, None, None, None),
]
# MOE_GPU_BENCH_TOKENS=1024 (comma-separated) narrows the bench, e.g. to look at one size.
BENCH_TOKENS = tuple(map(int, os.environ.get("MOE_GPU_BENCH_TOKENS", "1,16,128,1024").split(",")))


def deepseek_case(tokens):
    """bf16 pattern 7 at DeepSeek's shapes (hidden 7168, top 8 of 256), scales, shared expert."""
    return (7, "bfloat16", tokens, 7168, 8, 256, True, True, 1.0)


# The cases JAX repeats (every compile costs seconds): both patterns, both dtypes, routed
# scaling, one call above the one-shot threshold of 128 tokens.
JAX_CASES = [CASES[1], CASES[3], CASES[4], CASES[5], CASES[7], CASES[8]]


def case_name(c):
    pattern, dtype, tokens, hidden, k, experts, scale, shared, routed = c
    tail = ("-scale" if scale else "") + ("-shared" if shared else "")
    tail += f"-routed{routed}" if routed not in (None, 1.0) else ""
    return f"p{pattern}-{dtype}-t{tokens}-h{hidden}-k{k}-e{experts}{tail}"


def case_inputs(c, rng=None):
    """Every rank's numpy inputs of case ``c`` (the same in every process), drawn from
    ``rng`` (default: one seeded by the case)."""
    import tests.oracles.moe_oracle as mo

    pattern, dtype, tokens, hidden, k, experts = c[:6]
    if rng is None:
        rng = np.random.default_rng([pattern, tokens, hidden, k, experts])
    kw = dict(tokens=tokens, experts=experts, world=WORLD, dtype_name=dtype, hidden=hidden)
    if pattern == 7:
        return mo.random_finalize_case(rng, top_k=k, pad=2, **kw)
    return mo.random_reduction_case(rng, **kw)


JAX_CASE_NAMES = {case_name(c) for c in JAX_CASES}


def oracle_errors(c, inputs, outs):
    """(residual_out, norm_out[, allreduce_out]) errors as fractions of their bounds."""
    import tests.oracles.moe_oracle as mo

    i = inputs
    if c[0] == 7:
        scale = i["scale"] if c[6] else None
        local = lambda r: (i["permuted"][r], i["idx"][r], scale, i["shared"][r] if c[7] else None)
        exact = [mo.finalize_local64(*local(r), c[8]) for r in range(WORLD)]
    else:
        local = lambda r: (i["expert_outputs"][r], i["expert_scales"][r], i["token_input"][r])
        exact = [mo.reduction_local64(*local(r)) for r in range(WORLD)]
    s64, r64, y64, inv = mo.epilogue64(
        [e[0] for e in exact], i["residual"], i["gamma"], rms_eps=EPS, weight_bias=0.0
    )
    magnitude = sum(e[1] for e in exact) + np.abs(np.asarray(i["residual"], np.float64))
    kw = dict(s64=s64, r64=r64, y64=y64, inv64=inv, magnitude=magnitude, gamma=i["gamma"])
    roundings = WORLD * (2 * exact[0][2] + 1) + WORLD
    return mo.errors(outs, roundings=roundings, weight_bias=0.0, dtype_name=c[1], **kw)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


def to_device(torch, a, dev, dtype="bfloat16"):
    """The bits of a numpy 16-bit array as a torch ``dtype`` tensor on ``dev``."""
    t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).to(dev)
    return t.view(getattr(torch, dtype))


def case_tensors(torch, c, inputs, rank, dev):
    """This rank's tensors of case ``c`` on ``dev`` in its dtype: ``res``, ``g``, NaN ``res_out``
    and ``norm``; pattern 7's ``p``, ``idx``, ``s``, ``sh`` (None where the case has none), or
    pattern 6's ``es``, ``eo`` [experts * tokens, hidden], ``ti`` and NaN ``ar``."""
    to_t = lambda a: to_device(torch, a, dev, c[1])
    t = {"res": to_t(inputs["residual"]), "g": to_t(inputs["gamma"])}
    t["norm"] = torch.full_like(t["res"], float("nan"))
    t["res_out"] = torch.full_like(t["res"], float("nan"))
    if c[0] == 7:
        t["p"] = to_t(inputs["permuted"][rank])
        t["idx"] = torch.from_numpy(inputs["idx"][rank]).to(dev)
        t["s"] = to_t(inputs["scale"]) if c[6] else None
        t["sh"] = to_t(inputs["shared"][rank]) if c[7] else None
    else:
        t["es"] = torch.from_numpy(inputs["expert_scales"][rank]).to(dev)
        t["eo"] = to_t(inputs["expert_outputs"][rank]).reshape(c[5] * c[2], c[3])
        t["ti"] = to_t(inputs["token_input"][rank])
        t["ar"] = torch.full_like(t["res"], float("nan"))
    return t


def moe_call(c, t, **kw):
    """(input, keywords) of the unified allreduce_fusion call (torch_compat's and the
    anchor's) of case ``c`` on its tensors ``t`` (case_tensors'), plus ``kw``."""
    kw.update(residual_in=t["res"], rms_gamma=t["g"], residual_out=t["res_out"], norm_out=t["norm"])
    kw["rms_eps"] = EPS
    if c[0] == 7:
        kw.update(expanded_idx_to_permuted_idx=t["idx"], expert_scale_factor=t["s"])
        return t["p"], dict(kw, shared_expert_output=t["sh"])
    kw.update(moe_reduction_device_num_experts=c[5], moe_reduction_scale_input=t["es"])
    kw.update(moe_reduction_active_experts_token_input=t["eo"], output=t["ar"])
    return t["res"], dict(kw, moe_reduction_token_input=t["ti"])


def host_outputs(torch, c, t, dtype):
    """Case ``c``'s outputs (residual_out, norm_out[, allreduce_out]) as numpy ``dtype``."""
    outs = [t["res_out"], t["norm"]] + ([t["ar"]] if c[0] == 6 else [])
    return [o.cpu().view(torch.int16).numpy().view(dtype) for o in outs]


def _ranks_share_a_gpu():
    """True with fewer GPUs than ranks: correctness still runs (the kernels time-slice the GPU),
    the benches do not (their figures would mean nothing, and NCCL refuses shared GPUs)."""
    from jax_fusedar.common import native

    return native.gpu_count() < WORLD


# --- stage 1: torch ---------------------------------------------------------------------------


def _gloo_rank(rank, world, port):
    """(torch, torch.distributed, this rank's device) in a gloo group of the ranks."""
    import torch
    from tests.gpu.harness import device_for
    from tests.gpu.workers.common import init_gloo

    dev = torch.device("cuda", device_for(rank))
    return (*init_gloo(rank, world, port, dev), dev)


def _torch_rank(rank, world, channel, *, port, anchor_path, out_dir):
    torch, dist, dev = _gloo_rank(rank, world, port)
    # NCCL (the unfused baseline of the bench) needs one GPU per rank.
    nccl = None if _ranks_share_a_gpu() else dist.new_group(backend="nccl")
    import torch_compat as tc
    from torch_compat import library

    ws = tc.create_allreduce_fusion_workspace(
        "trtllm", world, rank, MAX_TOKENS, HIDDEN_WS, torch.bfloat16, group=dist.group.WORLD
    )
    fi = fws = None
    anchor_error = None
    try:
        from tests.gpu import anchor
        from tests.gpu.workers.common import anchor_workspace

        fi = anchor.load(anchor_path)
        fws = anchor_workspace(fi, dist, world, rank, MAX_TOKENS, HIDDEN_WS, torch.bfloat16)
    except Exception as e:  # reported, and the anchor comparisons are marked missing
        anchor_error = f"{type(e).__name__}: {e}"

    def run_case(c, inputs, impl):
        t = case_tensors(torch, c, inputs, rank, dev)
        if impl == "ours":
            x, kw = moe_call(c, t, launch_with_pdl=True)
            if c[0] == 7:
                kw["routed_scaling_factor"] = c[8]
            tc.allreduce_fusion(x, ws, c[0], **kw)
        elif c[0] == 7:
            kw = dict(allreduce_in=t["p"], residual_in=t["res"], norm_weight=t["g"], eps=EPS)
            kw.update(expanded_idx_to_permuted_idx=t["idx"], norm_out=t["norm"])
            kw.update(residual_out=t["res_out"], quant_out=None, scale_out=None)
            kw.update(workspace_ptrs=fws.workspace_tensor, launch_with_pdl=True)
            kw.update(world_rank=rank, world_size=world, weight_bias=0.0)
            kw.update(shared_expert_output=t["sh"], expert_scale_factor=t["s"])
            fi.trtllm_moe_finalize_allreduce_fusion(
                routed_scaling_factor=None if c[8] == 1.0 else c[8], **kw
            )
        else:
            x, kw = moe_call(c, t, launch_with_pdl=True)
            fi.allreduce_fusion(x, fws, 6, **kw)
        torch.cuda.synchronize()
        return host_outputs(torch, c, t, inputs["residual"].dtype)

    def say(*msg):
        if rank == 0:
            print(f"[torch {time.strftime('%T')}]", *msg, flush=True)

    say("workspaces ready; anchor:", anchor_error or "loaded")
    report = {"rank": rank, "anchor_error": anchor_error, "cases": {}}
    saved = {}
    for c in CASES:
        name = case_name(c)
        inputs = case_inputs(c)
        ours = run_case(c, inputs, "ours")
        entry = {}
        if rank == 0:
            entry["oracle_error_fraction_of_bound"] = oracle_errors(c, inputs, ours)
            for i, o in enumerate(ours):
                saved[f"{name}/{i}"] = o
        if fi is not None:
            theirs = run_case(c, inputs, "anchor")
            entry["bytes_differing_vs_anchor"] = [
                int((_bits(a) != _bits(b)).sum()) * 2 for a, b in zip(ours, theirs)
            ]
        # Every rank holds the same (all-reduced) rows.
        peers = channel.all_gather(f"bits/{name}", [o.tobytes() for o in ours])
        entry["ranks_identical"] = all(p == peers[0] for p in peers)
        report["cases"][name] = entry
        say(name, entry)
    if rank == 0:
        jax_cases = {k: v for k, v in saved.items() if k.split("/")[0] in JAX_CASE_NAMES}
        np.savez(Path(out_dir) / "moe_torch_outputs.npz", **jax_cases)

    if os.environ.get("MOE_GPU_CASES_ONLY") == "1":  # a short run: correctness only
        ws.destroy()
        dist.destroy_process_group()
        return report

    # CUDA graph: the custom op captured once, replayed with fresh inputs.
    c = deepseek_case(16)
    handle = library.register_workspace(ws)
    static = case_tensors(torch, c, case_inputs(c), rank, dev)
    op = torch.ops.torch_compat.moe_finalize_allreduce_residual_rmsnorm

    def call(t=static):
        return op(t["p"], t["idx"], t["res"], t["g"], t["s"], t["sh"], 1.0, EPS, 0.0, handle)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = call()
    mismatches = 0
    for i in range(5):
        static["res"].copy_(torch.randn_like(static["res"], dtype=torch.float32).bfloat16())
        static["p"].copy_(torch.randn_like(static["p"], dtype=torch.float32).bfloat16())
        graph.replay()
        eager = call()
        torch.cuda.synchronize()
        mismatches += int((gout[1].view(torch.int16) != eager[1].view(torch.int16)).sum())
    report["cuda_graph_replays_vs_eager_differing_elements"] = mismatches
    say("cuda graph replays vs eager, differing elements:", mismatches)

    # Back-to-back calls (no host sync between them, as in a graph or a model's layers) at the
    # workspace's largest size: a rank then starts its next call while a slower peer is still in
    # this one. FlashInfer's finalize kernel polls the peers' buffers, which a peer already in
    # its next call clears (docs/moe.md); this hung (or, with bounded waits, trapped).
    c = deepseek_case(MAX_TOKENS)
    big = case_tensors(torch, c, case_inputs(c), rank, dev)
    say("back-to-back calls at", MAX_TOKENS, "tokens")
    t0 = time.perf_counter()
    outs = [call(big) for _ in range(BACK_TO_BACK_CALLS)]
    torch.cuda.synchronize()
    first = outs[0][1].view(torch.int16)
    b2b = {"calls": BACK_TO_BACK_CALLS, "tokens": MAX_TOKENS}
    b2b["seconds"] = round(time.perf_counter() - t0, 3)
    differing = sum(int(not torch.equal(o[1].view(torch.int16), first)) for o in outs[1:])
    report["back_to_back"] = {**b2b, "calls_differing_from_the_first": differing}
    say("back-to-back:", report["back_to_back"])
    del outs

    # Bench at DeepSeek shapes: hidden 7168, top_k 8 of 256 experts, 2 ranks (expert parallel).
    def events_per_call(run, iters, reps=5):
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            channel.barrier("t")
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1000 / iters)
        return float(np.median(times))

    def graph_timed(fn, iters=20):
        """Per-call device time of ``iters`` calls captured in one CUDA graph; None on every
        rank when capture failed on any (so the ranks never fall out of step)."""
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        ok = True
        try:
            with torch.cuda.graph(g):
                for _ in range(iters):
                    fn()
        except Exception as e:  # noqa: BLE001 (reported as a missing figure)
            ok = False
            say("capture failed:", type(e).__name__, str(e)[:200])
        if not all(channel.all_gather("capture", ok)):
            return None
        return events_per_call(g.replay, iters)

    def eager_timed(fn, iters=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return events_per_call(lambda: [fn() for _ in range(iters)], iters)

    bench = {}
    # On a shared GPU MOE_GPU_BENCH_ON_SHARED_GPU=1 still runs the fused and anchor loops (no
    # NCCL baseline): their figures mean nothing there, but a loop that never ends shows.
    shared_loops = nccl is None and os.environ.get("MOE_GPU_BENCH_ON_SHARED_GPU") == "1"
    if nccl is None and not shared_loops:
        bench = "not run: ranks share a GPU (time-sliced kernels; NCCL needs one GPU per rank)"
        say("bench", bench)
    for tokens in BENCH_TOKENS if nccl is not None or shared_loops else ():
        c = deepseek_case(tokens)
        t = case_tensors(torch, c, case_inputs(c), rank, dev)
        idx, res, g_, s_, sh = (t[k] for k in ("idx", "res", "g", "s", "sh"))
        ro, no = t["res_out"], t["norm"]
        p_, kw = moe_call(c, t, launch_with_pdl=True)

        def fused():
            tc.allreduce_fusion(p_, ws, 7, **kw)

        def anchor_call():
            fi.allreduce_fusion(p_, fws, 7, **kw)

        valid = idx >= 0
        w = (s_.float() * valid)[..., None]
        safe = idx.clamp(min=0).long()

        def unfused():
            rows = p_[safe].float() * w  # gather + weight
            y = (rows.sum(1).bfloat16().float() + sh.float()).bfloat16()
            dist.all_reduce(y, group=nccl)  # NCCL
            r = (y.float() + res.float()).bfloat16()
            rf = r.float()
            n = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + EPS) * g_.float()
            ro.copy_(r)
            no.copy_(n.bfloat16())

        # Each step announced first: a hang shows where it is.
        say("bench", tokens, "fused (graph)")
        row = {"fused_torch_compat_graph_us": graph_timed(fused)}
        # The unfused sequence captured in a CUDA graph like the fused op (NCCL collectives
        # capture), so launch overhead does not count against it; eager as well, and as the
        # only figure if the capture fails.
        if nccl is not None:
            say("bench", tokens, "unfused (graph)")
            row["unfused_torch_nccl_graph_us"] = graph_timed(unfused)
            say("bench", tokens, "unfused (eager)")
            row["unfused_torch_nccl_eager_us"] = eager_timed(unfused)
        else:
            row["shared_gpu"] = "figures mean nothing: the ranks time-slice one GPU"
        if fi is not None and tokens <= ANCHOR_BENCH_MAX_TOKENS:
            say("bench", tokens, "anchor (graph)")
            row["anchor_flashinfer_graph_us"] = graph_timed(anchor_call)
        elif fi is not None:
            row["anchor_flashinfer_graph_us"] = (
                "not timed: FlashInfer's finalize kernel has the back-to-back race that hung "
                "our build here before its fix (docs/moe.md)"
            )
        bench[tokens] = row
        say("bench", tokens, row)
    report["bench_us_per_call"] = bench
    library.unregister_workspace(handle)
    ws.destroy()
    dist.destroy_process_group()
    return report


def stage_torch(out_dir, anchor_path):
    from tests.gpu import anchor
    from tests.gpu.harness import free_port, run_ranks

    # --anchor, else $JAX_FUSEDAR_ANCHOR, else the repository's .anchor folder: where that
    # folder looks complete, the ranks must inherit its environment to load it.
    where = anchor.path(anchor_path)
    if anchor.problem(where) is None:
        anchor.prepare_parent(where)
    anchor_path = str(where)
    # The harness kills the ranks itself on timeout (a shell timeout would orphan them, still
    # spinning on the GPUs).
    timeout_s = float(os.environ.get("MOE_GPU_TORCH_TIMEOUT_S", "240"))
    kw = dict(port=free_port(), anchor_path=anchor_path, out_dir=str(out_dir))
    return run_ranks(_torch_rank, WORLD, timeout_s=timeout_s, **kw)


# --- stage 2: JAX -----------------------------------------------------------------------------


def _jax_rank(rank, world, channel, *, port, out_dir):
    """One `jax.distributed` process per rank (one GPU each, or all sharing one GPU: the
    kernels time-slice it and the protocol still completes), as the JAX users' TP runs."""
    from tests.gpu.workers.jax_multiprocess import _global, _setup, _tp_mesh

    jax = _setup(rank, world, port, "")
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import jax_fusedar as jf

    mesh = _tp_mesh(jax)  # TP rank = process index: this process holds row `rank` below
    workspaces = {
        d: jax_workspace(jf, mesh, MAX_TOKENS, HIDDEN_WS, jnp.dtype(d), backend="trtllm")
        for d in ("bfloat16", "float16")
    }
    torch_out = np.load(Path(out_dir) / "moe_torch_outputs.npz")

    # P("tp") inputs are stacked [world, ...]: this process holds row `rank`.
    def put(a, spec):
        return _global(jax, mesh, spec, a[rank : rank + 1] if spec == P("tp") else a)

    mine = lambda o: np.asarray(o.addressable_data(0))
    report = {"rank": rank, "devices": [str(d) for d in jax.devices()], "cases": {}}

    def say(*msg):
        if rank == 0:
            print(f"[jax {time.strftime('%T')}]", *msg, flush=True)

    jx = dict(axis_name="tp", rms_eps=EPS, strict=True)

    def finalize(ws, c, p, i, sh, res, g, s):
        """The pattern-7 call of case ``c`` on this rank's shards (finalize_args' order)."""
        kw = dict(expert_scale_factor=s if c[6] else None, routed_scaling_factor=c[8])
        kw["shared_expert_output"] = sh[0] if c[7] else None
        return jf.moe_finalize_allreduce_fusion(
            p[0], i[0], workspace=ws, residual=res, rms_gamma=g, **kw, **jx
        )

    def finalize_fn(ws, c):
        def body(*args):
            out = finalize(ws, c, *args)
            return out.residual_out, out.norm_out

        return jit_shard_map(jax, body, mesh, (P("tp"),) * 3 + (P(),) * 3, (P(), P()))

    def finalize_args(inputs):
        """The global arrays of a pattern-7 case: permuted rows (padded to one length),
        indices and shared outputs stacked over the ranks, then residual, gamma, scales."""
        rows = max(p.shape[0] for p in inputs["permuted"])
        h = inputs["residual"].shape[1]
        pad = lambda p: np.concatenate([p, np.zeros((rows - p.shape[0], h), p.dtype)])
        perm = np.stack([pad(p) for p in inputs["permuted"]])
        stacked = (perm, np.stack(inputs["idx"]), np.stack(inputs["shared"]))
        replicated = [put(inputs[k], P()) for k in ("residual", "gamma", "scale")]
        return [put(a, P("tp")) for a in stacked] + replicated

    for c in JAX_CASES:
        name = case_name(c)
        inputs = case_inputs(c)
        ws = workspaces[c[1]]
        if c[0] == 7:
            f = finalize_fn(ws, c)
            args = finalize_args(inputs)
        else:

            def body(x, s, t, res, g, ws=ws):
                kw = dict(workspace=ws, residual=res, rms_gamma=g, return_allreduce_out=True)
                out = jf.moe_reduction_allreduce_fusion(x[0], s[0], t[0], **kw, **jx)
                return out.residual_out, out.norm_out, out.allreduce_out

            f = jit_shard_map(jax, body, mesh, (P("tp"),) * 3 + (P(),) * 2, (P(), P(), P()))
            keys = ("expert_outputs", "expert_scales", "token_input")
            args = [put(np.stack(inputs[k]), P("tp")) for k in keys]
            args += [put(inputs["residual"], P()), put(inputs["gamma"], P())]
        lowered = f.lower(*args)
        text = lowered.as_text()
        outs = [mine(o) for o in lowered.compile()(*args)]
        ref = [torch_out[f"{name}/{i}"] for i in range(len(outs))]
        report["cases"][name] = {
            "custom_call_in_hlo": "jax_fusedar_moe_allreduce_fusion_v1" in text,
            "elements_differing_vs_torch": [
                int((_bits(a) != _bits(b)).sum()) for a, b in zip(outs, ref)
            ],
            "oracle_error_fraction_of_bound": oracle_errors(c, inputs, outs),
        }
        say(name, report["cases"][name])

    if _ranks_share_a_gpu():
        report["bench_us_per_call_wall_clock_chain20"] = (
            "not run: ranks share a GPU (time-sliced kernels; XLA's psum needs one GPU per rank)"
        )
        return report
    # Bench: chains of dependent calls in one jit (the residual stream threads through).
    chain = 20
    bench = {}
    for tokens in BENCH_TOKENS:
        c = deepseek_case(tokens)
        inputs = case_inputs(c)

        def fused_chain(p, i, sh, res, g, s, c=c):
            def step(_, r):
                return finalize(workspaces["bfloat16"], c, p, i, sh, r, g, s).norm_out

            return jax.lax.fori_loop(0, chain, step, res)

        def unfused_chain(p, i, sh, res, g, s):
            def step(_, r):
                ii = i[0]
                valid = ii >= 0
                rows = jnp.take(p[0], jnp.where(valid, ii, 0), axis=0).astype(jnp.float32)
                w = jnp.where(valid, s.astype(jnp.float32), 0.0)[..., None]
                f32, bf16 = jnp.float32, jnp.bfloat16
                y = ((rows * w).sum(1).astype(bf16).astype(f32) + sh[0].astype(f32)).astype(bf16)
                y = jax.lax.psum(y, "tp")
                rf = (y.astype(f32) + r.astype(f32)).astype(bf16).astype(f32)
                n = rf * jax.lax.rsqrt(jnp.mean(rf * rf, -1, keepdims=True) + EPS) * g.astype(f32)
                return n.astype(bf16)

            return jax.lax.fori_loop(0, chain, step, res)

        args = finalize_args(inputs)
        row = {}
        for label, fn in (("fused_jax_us", fused_chain), ("unfused_xla_us", unfused_chain)):
            f = jit_shard_map(jax, fn, mesh, (P("tp"),) * 3 + (P(),) * 3, P())
            f(*args).block_until_ready()
            times = []
            for _ in range(7):
                channel.barrier(f"{label}/{tokens}")
                t0 = time.perf_counter()
                f(*args).block_until_ready()
                times.append((time.perf_counter() - t0) * 1e6 / chain)
            row[label] = float(np.median(times))
        bench[tokens] = row
        say("bench", tokens, row)
    report["bench_us_per_call_wall_clock_chain20"] = bench
    return report


def stage_jax(out_dir):
    from tests.gpu.harness import free_port, run_ranks

    timeout_s = float(os.environ.get("MOE_GPU_JAX_TIMEOUT_S", "300"))
    return run_ranks(_jax_rank, WORLD, timeout_s=timeout_s, port=free_port(), out_dir=str(out_dir))


# --- stage 3: the anchor at hidden 2880 ----------------------------------------------------


def _anchor_2880_rank(rank, world, channel, *, port, anchor_path):
    torch, dist, dev = _gloo_rank(rank, world, port)
    from tests.gpu import anchor
    from tests.gpu.workers.common import anchor_workspace

    fi = anchor.load(anchor_path)
    fws = anchor_workspace(fi, dist, world, rank, 64, 2880, torch.bfloat16)
    c = (7, "bfloat16", 16, 2880, 4, 32, True, True, 1.0)
    inputs = case_inputs(c)
    t = case_tensors(torch, c, inputs, rank, dev)
    x, kw = moe_call(c, t)
    fi.allreduce_fusion(x, fws, 7, **kw)
    torch.cuda.synchronize()
    outs = host_outputs(torch, c, t, inputs["residual"].dtype)
    errs = oracle_errors(c, inputs, outs) if rank == 0 else None
    dist.destroy_process_group()
    return {"rank": rank, "oracle_error_fraction_of_bound": errs}


def stage_anchor_2880(anchor_path):
    from tests.gpu import anchor
    from tests.gpu.harness import free_port, run_ranks

    anchor.prepare_parent(anchor.path(anchor_path))
    kw = dict(timeout_s=25, port=free_port(), anchor_path=anchor_path)
    return run_ranks(_anchor_2880_rank, WORLD, **kw)


def main(argv=None):
    global WORLD
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--anchor", default=None)
    ap.add_argument("--stages", default="torch,jax,anchor2880")
    ap.add_argument("--world", type=int, default=WORLD, choices=(2, 4, 8))
    a = ap.parse_args(argv)
    WORLD = a.world
    os.environ[WORLD_ENV_VAR] = str(a.world)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for stage in a.stages.split(","):
        t0 = time.time()
        stages = {"torch": lambda: stage_torch(out, a.anchor), "jax": lambda: stage_jax(out)}
        stages["anchor2880"] = lambda: stage_anchor_2880(a.anchor)
        try:
            if stage not in stages:
                raise ValueError(f"unknown stage {stage}")
            result = stages[stage]()
        except Exception as e:
            import traceback

            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result = {"stage": stage, "seconds": round(time.time() - t0, 1), "result": result}
        (out / f"moe_{stage}.json").write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps(result, default=str)[:6000], flush=True)


if __name__ == "__main__":
    main()
