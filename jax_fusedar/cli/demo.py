"""``python -m jax_fusedar demo``: a Llama decoder written without jax_fusedar, fused by
``jax_fusedar.fuse``.

The model (``jax_fusedar.models.llama``: RMSNorm, RoPE, grouped-query attention with a KV
cache, SwiGLU, Megatron tensor parallelism under ``shard_map``, random weights) contains
``lax.psum`` + residual add + RMSNorm in plain jnp and no jax_fusedar call. The demo runs it
as written (unfused) and through ``jax_fusedar.fuse`` (fused), layers unrolled and under
``lax.scan``, and prints: the sites fused (the pass's report), prefill and decode tokens/s,
the greedy tokens of N decode steps (identical, or the first divergence with the logit
margins), and the largest logits difference. Llama-3-8B shapes on GPUs, a small config on
CPUs (8 virtual devices, the XLA reference path).

``--bench`` times decode steps (batch x KV length) and prefills of both versions instead,
and writes ``bench_llama.json`` (see ``bench_main``).

The mesh, workspace and device description come from ``setup``, the comparison with the
unfused program (greedy tokens, margins, tolerance, timing) from ``compare``, both shared with
the MoE demo.
"""

from __future__ import annotations

import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from . import demo_args
from .compare import TOLERANCE_FORMULA, compare_greedy, median_seconds, near_tie, tolerance
from .setup import AXIS, describe_devices, llama_preset, open_workspace, require_fuse_jax, tp_mesh


# --- the Llama demo ------------------------------------------------------------------------------

LAYER_MODES = demo_args.LAYER_MODES
_T0 = time.perf_counter()  # process start (about): the bench's total time includes init
# Virtual CPU devices are threads of one process sharing this host's cores, and both programs
# run XLA's own collectives there (the reference path): their tok/s time XLA on this CPU,
# whose ratio moved from 0.12 to 2.5 between runs of one commit, so no speedup is shown.
CPU_TIMINGS = (
    "timings (CPU): virtual devices sharing this host's cores, both programs on XLA's "
    "collectives (the reference path, not the kernel): tok/s of XLA on this CPU, no speedup"
)


@contextlib.contextmanager
def progress(what: str):
    """One line on stderr per phase (compiling takes 20-125 s on CPUs, minutes for
    llama3-8b): what runs, then how long it took, on the same line."""
    print(f"jax_fusedar demo: {what} ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        print(f" {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def _modes(args):
    return LAYER_MODES if args.layer_mode == "both" else (args.layer_mode,)


def main(args) -> int:
    from ..fusion.transform import fuse
    from ..models import llama

    require_fuse_jax()
    mesh = tp_mesh(args.tp)
    world = mesh.shape[AXIS]
    preset, cfg = llama_preset(args, world)
    if args.bench:
        return bench_main(args, preset, cfg, mesh)
    dtype = jnp.dtype(args.dtype)
    on_gpu = jax.devices()[0].platform == "gpu"
    stacked = llama.init_params(cfg, mesh, AXIS, dtype, args.seed, host=not on_gpu)
    rng = np.random.default_rng(args.seed + 1)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab, (args.batch, args.prompt)), jnp.int32)
    length = args.prompt + args.steps
    norm = llama.NORMS[args.norm]
    print(
        f"jax_fusedar demo: Llama decoder ({preset}: {cfg.layers} layers, hidden {cfg.hidden}, "
        f"ffn {cfg.ffn}, {cfg.heads}/{cfg.kv_heads} heads, vocab {cfg.vocab}), {args.dtype}, "
        f"random weights (seed {args.seed}), tensor parallel over {world} devices; batch "
        f"{args.batch}, prompt {args.prompt}, {args.steps} greedy steps; norm "
        f"{args.norm}"
    )
    print("the model calls no jax_fusedar function; 'fused' = jax_fusedar.fuse(model)")
    ok = True
    with open_workspace(
        mesh,
        max_token_num=args.batch * args.prompt,
        hidden_dim=cfg.hidden,
        dtype=dtype,
        backend=args.backend,
    ) as ws:
        print(describe_devices(world, ws.backend))
        for mode in _modes(args):
            fwd = llama.make_forward(cfg, mesh, AXIS, scan=mode == "scan", norm=norm)
            fused = fuse(fwd, workspace=ws, allow_rounding_change=args.allow_rounding_change)
            params = llama.arrange(stacked, mesh, AXIS, scan=mode == "scan")
            progs = {"unfused": jax.jit(fwd), "fused": jax.jit(fused)}
            cache = llama.init_cache(cfg, mesh, AXIS, dtype, args.batch, length)
            tok1 = prompt[:, :1]
            pos_d = jnp.int32(args.prompt)
            with progress(f"fusing the model (layers {mode}): jax_fusedar.fuse traces it"):
                reports = {
                    "prefill": fused.analyze(params, prompt, *cache, jnp.int32(0)),
                    "decode": fused.analyze(params, tok1, *cache, pos_d),
                }
            outs, speed = {}, {}
            for name, prog in progs.items():
                with progress(f"compiling the {name} prefill and decode programs (layers {mode})"):
                    pre = prog.lower(params, prompt, *cache, jnp.int32(0)).compile()
                    dec = prog.lower(params, tok1, *cache, pos_d).compile()
                with progress(f"running the {name} programs: {args.steps} greedy steps, timing"):
                    outs[name] = llama.greedy_decode(pre, dec, params, prompt, *cache, args.steps)
                    t_pre = median_seconds(pre, (params, prompt, *cache, jnp.int32(0)), args.iters)
                    t_dec = median_seconds(dec, (params, tok1, *cache, pos_d), args.iters)
                speed[name] = (args.batch * args.prompt / t_pre, args.batch / t_dec)
                del pre, dec
            first, err, scale, margins = compare_greedy(*outs["unfused"], *outs["fused"])
            sites = reports["decode"]
            n_sites = sum(s.runs for s in sites.sites)  # executed per call (scan bodies x L)
            tol = tolerance(args.dtype, world, n_sites)
            rel = err / scale if scale else float("inf")
            print()
            print(f"== layers {mode} ==")
            for what, rep in reports.items():
                print(f"{what}: {rep.line()}")
            if not on_gpu:
                print(CPU_TIMINGS)
            print(f"{'':<8} {'prefill tok/s':>14} {'decode tok/s':>13}")
            for name, (p, d) in speed.items():
                print(f"{name:<8} {p:>14.1f} {d:>13.1f}")
            if on_gpu:  # one GPU per rank: a measurement of the programs
                print(
                    f"speedup  {speed['fused'][0] / speed['unfused'][0]:>14.3f} "
                    f"{speed['fused'][1] / speed['unfused'][1]:>13.3f}"
                )
            tu, tf = outs["unfused"][0], outs["fused"][0]
            print(f"greedy tokens, sequence 0, unfused: {tu[0].tolist()}")
            print(f"greedy tokens, sequence 0, fused:   {tf[0].tolist()}")
            if first is None:
                print(f"greedy tokens: identical over {args.steps} steps x {args.batch} sequences")
            else:
                print(
                    f"greedy tokens: first divergence at step {first[0]}, sequence {first[1]} "
                    f"({margins})"
                )
            print(
                f"max logits error {err:.4g} (relative to max |logits| {scale:.4g}: "
                f"{rel:.3e}; tolerance {tol:.3e} = {TOLERANCE_FORMULA} with "
                f"{n_sites} sites)"
            )
            # Every site fused (both norms: Hugging Face's gamma multiplication stays after
            # the fused norm).
            all_fused = len(sites.fused) == len(sites.sites) > 0
            # "not <=" so that NaN fails. A divergence is accepted only at a near tie.
            diverged_ok = first is None or near_tie(outs["unfused"][1], first, err)
            mode_ok = rel <= tol and diverged_ok and all_fused
            print(f"{'PASS' if mode_ok else 'FAIL'} ({mode})")
            ok &= bool(mode_ok)
    return 0 if ok else 1


# --- --bench -------------------------------------------------------------------------------------


def _time_steps(prog, params, tokens, cache, pos, steps: int, iters: int):
    """(median seconds per call over ``iters`` runs of ``steps`` back-to-back calls, cache):
    wall time from the first dispatch to the last result, so host dispatch gaps count, as
    in serving. The cache is threaded through (donated where the platform allows)."""
    ck, cv = cache
    logits, ck, cv = prog(params, tokens, ck, cv, pos)  # warm-up (compiled already)
    jax.block_until_ready(logits)
    per = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, ck, cv = prog(params, tokens, ck, cv, pos)
        jax.block_until_ready(logits)
        per.append((time.perf_counter() - t0) / steps)
    return statistics.median(per), (ck, cv)


def bench_main(args, preset, cfg, mesh) -> int:
    """Decode step and prefill wall times of the Llama model, unfused vs fused, for every
    layer mode x (batch x KV length) and prefill length, in one process; JSON to --out."""
    from ..fusion.transform import fuse
    from ..models import llama

    world = mesh.shape[AXIS]
    dtype = jnp.dtype(args.dtype)
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    prefills = list(args.bench_prefill)
    pre_modes = {"both": LAYER_MODES, "none": ()}.get(
        args.bench_prefill_layers, (args.bench_prefill_layers,)
    )
    max_tokens = max([*args.bench_batches, *(prefills if pre_modes else [])])
    stacked = llama.init_params(cfg, mesh, AXIS, dtype, args.seed, host=not on_gpu)
    donate = (2, 3) if on_gpu else ()
    cases, skipped = [], []
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"jax_fusedar demo --bench: Llama ({preset}: {cfg.layers} layers, hidden {cfg.hidden}, "
        f"ffn {cfg.ffn}, {cfg.heads}/{cfg.kv_heads} heads), {args.dtype}, TP {world}; "
        f"{args.bench_steps} calls per run, median of {args.iters} runs",
        flush=True,
    )
    with open_workspace(
        mesh, max_token_num=max_tokens, hidden_dim=cfg.hidden, dtype=dtype, backend=args.backend
    ) as ws:
        print(describe_devices(world, ws.backend), flush=True)
        if ws.backend != "trtllm":
            print("NOTE: backend 'xla': 'fused' runs the reference path, not the kernel")
        header = (
            f"{'kind':<8} {'layers':<9} {'batch':>5} {'kv/len':>6} {'unfused ms':>11} "
            f"{'fused ms':>9} {'speedup':>8} {'fused tok/s':>12}  sites"
        )
        print(header, flush=True)
        # Most telling first (batch-1 decode), and the JSON rewritten after every case, so
        # a run cut short still leaves its numbers.
        plan = [
            (mode, "decode", b, kv)
            for b in args.bench_batches
            for mode in _modes(args)
            for kv in args.bench_kv
        ]
        plan += [(mode, "prefill", 1, t) for mode in pre_modes for t in prefills]
        progs_by_mode, params_by_mode = {}, {}
        start = time.perf_counter()
        for mode, kind, batch, length in plan:
            if args.bench_budget_s and time.perf_counter() - start > args.bench_budget_s:
                skipped.append({"kind": kind, "layers": mode, "batch": batch, "length": length})
                print(
                    f"skipped (--bench-budget-s {args.bench_budget_s}): {kind} {mode} "
                    f"batch {batch} length {length}",
                    flush=True,
                )
                continue
            if mode not in progs_by_mode:
                fwd = llama.make_forward(cfg, mesh, AXIS, scan=mode == "scan")
                fused = fuse(fwd, workspace=ws)
                # Each mode reads its own layout (llama.arrange): one copy of the layer
                # weights per mode, made once, as a server loads its weights once.
                params_by_mode[mode] = llama.arrange(stacked, mesh, AXIS, scan=mode == "scan")
                progs_by_mode[mode] = (
                    fused,
                    {
                        "unfused": jax.jit(fwd, donate_argnums=donate),
                        "fused": jax.jit(fused, donate_argnums=donate),
                    },
                )
            fused, progs = progs_by_mode[mode]
            params = params_by_mode[mode]
            T = 1 if kind == "decode" else length
            pos = jnp.int32(length - 1 if kind == "decode" else 0)
            tokens = jnp.zeros((batch, T), jnp.int32)
            cache = llama.init_cache(cfg, mesh, AXIS, dtype, batch, length)
            case = {
                "kind": kind,
                "layers": mode,
                "batch": batch,
                "kv_length" if kind == "decode" else "tokens": length,
            }
            steps = args.bench_steps if kind == "decode" else max(2, args.bench_steps // 10)
            for name, prog in progs.items():
                t0 = time.perf_counter()
                compiled = prog.lower(params, tokens, *cache, pos).compile()
                case[f"{name}_compile_s"] = time.perf_counter() - t0
                s, cache = _time_steps(compiled, params, tokens, cache, pos, steps, args.iters)
                del compiled
                case[f"{name}_ms"] = s * 1e3
            rep = fused.report
            case["fused_sites"] = len(rep.fused)
            case["sites"] = len(rep.sites)
            case["not_fused"] = dict(rep.reasons())
            case["speedup"] = case["unfused_ms"] / case["fused_ms"]
            case["fused_tokens_per_s"] = batch * T / (case["fused_ms"] * 1e-3)
            case["unfused_tokens_per_s"] = batch * T / (case["unfused_ms"] * 1e-3)
            cases.append(case)
            print(
                f"{kind:<8} {mode:<9} {batch:>5} {length:>6} {case['unfused_ms']:>11.3f} "
                f"{case['fused_ms']:>9.3f} {case['speedup']:>8.3f} "
                f"{case['fused_tokens_per_s']:>12.1f}  {len(rep.fused)}/{len(rep.sites)} "
                f"(compile {case['unfused_compile_s']:.0f}+{case['fused_compile_s']:.0f} s)",
                flush=True,
            )
            del cache
            _write_bench(
                out_dir, device, world, ws.backend, preset, cfg, args, max_tokens, cases, skipped
            )
    path = _write_bench(
        out_dir, device, world, ws.backend, preset, cfg, args, max_tokens, cases, skipped
    )
    dec1 = [c["speedup"] for c in cases if c["kind"] == "decode" and c["batch"] == 1]
    if dec1:
        print(f"decode batch 1 speedup: {min(dec1):.3f} - {max(dec1):.3f}")
    if cases:
        print(
            f"slowest case fused/unfused: {max(c['fused_ms'] / c['unfused_ms'] for c in cases):.3f}"
        )
    print(f"total {time.perf_counter() - _T0:.0f} s")
    print(f"wrote {path}")
    return 0


def _write_bench(out_dir, device, world, backend, preset, cfg, args, max_tokens, cases, skipped):
    report = {
        "machine": {
            "platform": device.platform,
            "device_kind": device.device_kind,
            "device_count": jax.device_count(),
            "world_size": world,
            "backend": backend,
            "jax_version": jax.__version__,
            "host": platform.node(),
        },
        "config": {
            "preset": preset,
            **{
                k: getattr(cfg, k)
                for k in ("vocab", "hidden", "ffn", "layers", "heads", "kv_heads")
            },
            "dtype": args.dtype,
            "steps_per_run": args.bench_steps,
            "runs": args.iters,
            "workspace_max_tokens": max_tokens,
        },
        "method": "wall time of back-to-back jitted calls (--bench-steps per run for decode, "
        "a tenth of that (>= 2) for prefill; cache threaded through, donated on "
        "GPUs) / calls, median over runs; compile excluded",
        "cases": cases,
        "skipped": skipped,
        "total_s": time.perf_counter() - _T0,
    }
    path = out_dir / "bench_llama.json"
    path.write_text(json.dumps(report, indent=1))
    return path
