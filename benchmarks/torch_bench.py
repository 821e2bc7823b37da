"""``python -m benchmarks.torch_bench``: torch_compat's fused all-reduce against FlashInfer's own
build of the same kernel (the "anchor"), NCCL and torch symmetric memory. A client of the
public API (``torch_compat``, ``jax_fusedar.common.plan`` and ``sizing``) and of the anchor
loader it is given (``tools/flashinfer_anchor.py``); run it from the repository root.

The command spawns ``--world`` processes (one GPU each) itself. Every process joins a gloo
group (torch_compat's workspace exchange goes over its c10d store; gloo also carries the
small host-side agreements of this benchmark) and, when every rank has a GPU of its own, an
NCCL group for the NCCL baseline. For every tokens x hidden case it times, in one run:

* ``ours``      torch_compat.allreduce_fusion, pattern 1 (all-reduce + residual add + RMSNorm)
* ``anchor``    FlashInfer 0.7.2.post1's own ``flashinfer.comm.allreduce_fusion`` (backend
                "trtllm", never "auto": auto may pick MNNVL, which needs NVLink multicast)
* ``nccl``      ``dist.all_reduce`` (NCCL, NVLS off) + residual add + ``F.rms_norm``
* ``symm_mem``  torch symmetric memory one-shot all-reduce (multicast off) + add + RMSNorm
* ``ours_fp8`` / ``anchor_fp8``  pattern 4 (static FP8 quant_out plus norm_out)
* ``ours_no_timeout`` (with ``--timeout-compare``) ``ours`` on a second workspace created
                with ``kernel_timeout_s=0`` (FlashInfer's spin-forever waits), so the cost
                of the always-on wait timeout shows as the ``ours/ours_no_timeout`` ratio

each eagerly (a loop of ``--iters`` calls between two CUDA events) and captured in a CUDA
graph (``--iters`` calls per graph, one replay between two events), per call = elapsed /
iters, one sample per ``--repeats``; a case's figure is the slowest rank's: the rank whose
median is the largest, with that rank's p10, p90 and sample count. Ours and the anchor run
the same one-shot/two-shot choice (``common.plan.kernel_choice``: FlashInfer's policy, passed
explicitly to both) with ``fp32_acc=True``. Results: a table on stdout, ``bench_torch.json``
and ``bench_torch.png`` under ``--out``.

The anchor is a measuring instrument of the source checkout, loaded only here (and by the GPU
tests) by ``tools/flashinfer_anchor.py``, only when its folder exists: ``--anchor``, else
``$JAX_FUSEDAR_ANCHOR``, else ``<repository>/.anchor/anchor-flashinfer``.
This module imports torch lazily, so its pure parts (arguments, plan, report, table, anchor
path checks) run anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from benchmarks import report as report_files
from benchmarks.report import (
    DTYPES,
    USE_ONESHOT,
    check_out_dir,
    int_list,
    mode_list,
    positive_int,
    seed,
)
from jax_fusedar.common import plan as rules, sizing

PROG = "python -m benchmarks.torch_bench"

# NVLink multicast stays off in every process this command starts (docs/decisions.md): forced, not
# defaulted, so a stray setting in the caller's environment cannot turn it on.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

RMS_EPS = 1e-6
FP8_PATTERN = 4  # kARResidualRMSNormOutFP8Quant: residual_out, norm_out, quant_out
NORM_PATTERN = 1  # kARResidualRMSNorm
FP8_MAX = 448.0

IMPLS = ("ours", "anchor", "nccl", "symm_mem", "ours_fp8", "anchor_fp8", "ours_no_timeout")
HOWS = ("eager", "graph")
# (numerator, denominator) of the reported ratios, for each of eager and graph.
RATIOS = (
    ("ours", "anchor"),
    ("ours", "nccl"),
    ("ours", "symm_mem"),
    ("ours_fp8", "anchor_fp8"),
    ("ours", "ours_no_timeout"),
)

# --------------------------------------------------------------------------------------------
# The anchor: FlashInfer's own build, a measuring instrument of the source checkout
# --------------------------------------------------------------------------------------------

ANCHOR_ENV_VAR = "JAX_FUSEDAR_ANCHOR"


def anchor_loader():
    """The anchor loader, ``tools/flashinfer_anchor.py`` of the checkout (as the benchmarks
    are: run from the repository root): FlashInfer's own build, which only a checkout
    holds."""
    from tools import flashinfer_anchor

    return flashinfer_anchor


# --------------------------------------------------------------------------------------------
# Arguments and plan (pure)
# --------------------------------------------------------------------------------------------


def _world(text: str) -> int:
    value = positive_int(text)
    try:  # the world sizes the kernel is built for (a workspace of any other is refused)
        sizing.workspace_sizes(value, 1, 16, "bfloat16")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Time torch_compat's fused all-reduce + residual add + RMSNorm against "
        "FlashInfer's own build (the anchor), NCCL all_reduce + add + RMSNorm and torch "
        "symmetric-memory one-shot all-reduce + add + RMSNorm, eager and in CUDA graphs, in "
        "--world spawned processes (one GPU each). Writes bench_torch.json and bench_torch.png.",
    )
    p.add_argument(
        "--tokens", type=int_list, default="1,16,128,1024,4096", help="comma-separated token counts"
    )
    p.add_argument(
        "--hidden", type=int_list, default="4096,8192", help="comma-separated hidden sizes"
    )
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--world", type=_world, default=2, help="processes (TP ranks) to spawn")
    p.add_argument(
        "--modes",
        type=mode_list,
        default="auto",
        help="one-shot/two-shot choices to time, each a row per case: auto (the "
        "op's policy, FlashInfer's heuristic), oneshot, twoshot (forced); ours and "
        "the anchor always get the same one explicitly",
    )
    p.add_argument(
        "--iters",
        type=positive_int,
        default=100,
        help="calls per timed eager loop and per captured CUDA graph",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed loops (or graph replays) per variant; the median is reported",
    )
    p.add_argument(
        "--warmup",
        type=positive_int,
        default=5,
        help="untimed calls of each variant before its timings and its capture",
    )
    p.add_argument(
        "--out", default="bench_out", help="folder for bench_torch.json and bench_torch.png"
    )
    p.add_argument(
        "--anchor",
        default=None,
        help=f"anchor-flashinfer folder (default ${ANCHOR_ENV_VAR}, else "
        "<repository>/.anchor/anchor-flashinfer; loaded by the checkout's "
        "tools/flashinfer_anchor.py)",
    )
    p.add_argument("--no-anchor", action="store_true", help="do not load the anchor")
    p.add_argument("--no-graph", action="store_true", help="eager timings only")
    p.add_argument("--no-fp8", action="store_true", help="skip the pattern-4 FP8 rows")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL baseline")
    p.add_argument(
        "--no-symm-mem", action="store_true", help="skip the torch symmetric-memory baseline"
    )
    p.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch ours and the anchor without programmatic dependent launch",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of the random inputs")
    p.add_argument(
        "--timeout-compare",
        action="store_true",
        help="also time ours with the kernel's wait timeout off (a second "
        "workspace with kernel_timeout_s=0): the ours/ours_no_timeout ratio",
    )
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=1200,
        help="seconds before the whole run is killed (a kernel waiting for a peer "
        "that never comes spins forever)",
    )
    return p


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """The hidden sizes the kernel launches (``common.plan``'s rule for a call of one
    token on a workspace of that hidden size)."""
    for hidden in args.hidden:
        sizes = sizing.workspace_sizes(args.world, 1, hidden, args.dtype)
        problem = rules.kernel_problem(rules.Call(rules.DENSE_RULE, 1, hidden, args.dtype, sizes))
        if problem:
            parser.error(f"--hidden {hidden}: {problem[1]}")


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = PROG):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    check_args(parser, args)
    problem = check_out_dir(args.out, ("bench_torch.json", "bench_torch.png"))
    if problem:  # before any rank is spawned
        parser.error(f"--out {args.out}: {problem}")
    return args


@dataclass
class Case:
    tokens: int
    hidden: int
    oneshot: Optional[bool]  # the policy's choice, used by ours and the anchor alike
    skipped: Dict[str, str] = field(default_factory=dict)
    policy: str = "auto"  # --modes entry: auto (the op's own choice), oneshot, twoshot

    @property
    def mode(self) -> Optional[str]:
        return None if self.oneshot is None else ("oneshot" if self.oneshot else "twoshot")


def plan_cases(
    tokens: Sequence[int],
    hiddens: Sequence[int],
    dtype_name: str,
    world: int,
    modes: Sequence[str] = ("auto",),
) -> tuple:
    """(workspace sizes, cases): one workspace of max(tokens) x max(hidden) serves every
    case (FlashInfer's element-count rule). A case's one-shot/two-shot choice is
    ``common.plan.kernel_choice`` (our op's choice between FlashInfer's two kernels): for
    mode "auto" FlashInfer's size heuristic, for "oneshot"/"twoshot" that mode forced, or the
    reason it cannot run."""
    sizes = sizing.workspace_sizes(world, max(tokens), max(hiddens), dtype_name)
    cases = []
    for hidden in hiddens:
        for m in tokens:
            for mode in modes:
                call = rules.Call(
                    rules.DENSE_RULE, m, hidden, dtype_name, sizes, use_oneshot=USE_ONESHOT[mode]
                )
                try:
                    oneshot = rules.kernel_choice(call) == "oneshot"
                    cases.append(Case(m, hidden, oneshot, policy=mode))
                except ValueError as e:
                    cases.append(Case(m, hidden, None, {i: str(e) for i in IMPLS}, mode))
    return sizes, cases


def variant_keys(args) -> List[str]:
    """``impl:how`` for every variant this run asks for (before runtime skips)."""
    impls = [
        i
        for i in IMPLS
        if not (args.no_anchor and i.startswith("anchor"))
        and not (args.no_fp8 and i.endswith("_fp8"))
        and not (args.no_nccl and i == "nccl")
        and not (args.no_symm_mem and i == "symm_mem")
        and not (i == "ours_no_timeout" and not getattr(args, "timeout_compare", False))
    ]
    hows = ("eager",) if args.no_graph else HOWS
    return [f"{i}:{h}" for i in impls for h in hows]


# --------------------------------------------------------------------------------------------
# Report (pure): merge the ranks, ratios, table, plot
# --------------------------------------------------------------------------------------------


def merge_ranks(rank_results: Sequence[dict]) -> List[dict]:
    """One entry per case: per variant the slowest rank's median (a collective takes as long
    as its slowest member) and that rank's summary (median, p10, p90, n), each rank's median
    and repeats, the skips of any rank."""
    cases = []
    for per_rank in zip(*(r["cases"] for r in rank_results)):
        first = per_rank[0]
        keys = [k for k in first["us_repeats"] if all(k in c["us_repeats"] for c in per_rank)]
        skipped: Dict[str, str] = {}
        for c in per_rank:
            for k, why in c["skipped"].items():
                skipped.setdefault(k, why)
        for c in per_rank:  # a variant timed on some ranks only (should not happen)
            for k in c["us_repeats"]:
                if k not in keys:
                    skipped.setdefault(k, "not timed on every rank")
        medians = {k: [statistics.median(c["us_repeats"][k]) for c in per_rank] for k in keys}
        us = {k: max(v) for k, v in medians.items()}
        slowest = {k: max(range(len(v)), key=v.__getitem__) for k, v in medians.items()}
        stats = {k: report_files.summary(per_rank[r]["us_repeats"][k]) for k, r in slowest.items()}
        ratios = {}
        for how in HOWS:
            for num, den in RATIOS:
                a, b = us.get(f"{num}:{how}"), us.get(f"{den}:{how}")
                if a is not None and b is not None and b > 0:
                    ratios[f"{num}/{den}:{how}"] = a / b
        cases.append(
            {
                "tokens": first["tokens"],
                "hidden": first["hidden"],
                "mode": first["mode"],
                "policy": first.get("policy", "auto"),
                "us": us,
                "stats": stats,
                "slowest_rank": slowest,
                "us_per_rank": medians,
                "us_repeats": {k: [c["us_repeats"][k] for c in per_rank] for k in keys},
                "ratios": ratios,
                "skipped": skipped,
            }
        )
    return cases


def build_report(rank_results: Sequence[dict], args, machine: dict, anchor: dict) -> dict:
    return {
        "machine": machine,
        "config": {
            "dtype": args.dtype,
            "world_size": args.world,
            "tokens": list(args.tokens),
            "hidden": list(args.hidden),
            "modes": list(args.modes),
            "iters": args.iters,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "variants": variant_keys(args),
            "launch_with_pdl": not args.no_pdl,
            "fp32_acc": True,
            "rms_eps": RMS_EPS,
            "fp8_pattern": FP8_PATTERN,
            "max_token_num": max(args.tokens),
            "hidden_dim": max(args.hidden),
            "seed": args.seed,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "anchor": anchor,
        "method": (
            "eager: CUDA events around a loop of iters calls; graph: iters calls "
            "captured in one CUDA graph, events around one replay; per call = elapsed "
            "/ iters; per rank the median over repeats, reported the slowest rank's. "
            "Ranks meet at a gloo barrier (GPU idle) before every timed loop. ours and "
            "anchor get the same explicit use_oneshot (common.plan.kernel_choice); "
            "the anchor gets a preallocated output= so that it does not allocate the "
            "unused [M,H] all-reduce output on every call; nccl all-reduces in place "
            "(its values grow, which does not change its timing)."
        ),
        "rank_notes": [r.get("notes", {}) for r in rank_results],
        "cases": merge_ranks(rank_results),
    }


# The ratio columns: (label, numerator/denominator).
_RATIO_COLUMNS = (
    ("ours/anc", "ours/anchor"),
    ("ours/nccl", "ours/nccl"),
    ("ours/symm", "ours/symm_mem"),
    ("fp8 o/a", "ours_fp8/anchor_fp8"),
    ("on/off", "ours/ours_no_timeout"),
)


def format_table(report: dict) -> str:
    """Per eager/graph: one row per case and variant, its us per call as the slowest rank's
    median [p10, p90] and sample count; then the ratios of the medians ('-' where a variant
    did not run) and one line per skip reason."""
    lines = []
    hows = sorted({k.split(":")[1] for k in report["config"]["variants"]}, key=HOWS.index)
    impls = [i for i in IMPLS if any(k.startswith(i + ":") for k in report["config"]["variants"])]
    for how in hows:
        lines.append(f"[{how}] us per call: the slowest rank's median [p10, p90], n samples")
        lines.append(
            f"{'tokens':>6} {'hidden':>6} {'mode':<16} {'variant':<16} "
            f"{'us [p10, p90]':>25} {'n':>4}"
        )
        for c in report["cases"]:
            for impl in impls:
                st = c.get("stats", {}).get(f"{impl}:{how}")
                if st is not None:
                    lines.append(
                        f"{c['tokens']:>6} {c['hidden']:>6} {_mode_label(c):<16} {impl:<16} "
                        f"{report_files.spread(st):>25} {st['n']:>4}"
                    )
        lines.append("")
        lines.append(f"[{how}] ratios of the medians; < 1: ours faster")
        lines.append(
            f"{'tokens':>6} {'hidden':>6} {'mode':<16}"
            + "".join(f" {label:>9}" for label, _ in _RATIO_COLUMNS)
        )
        for c in report["cases"]:
            cells = []
            for _, key in _RATIO_COLUMNS:
                v = c["ratios"].get(f"{key}:{how}")
                cells.append(f" {v:>9.3f}" if v is not None else f" {'-':>9}")
            lines.append(f"{c['tokens']:>6} {c['hidden']:>6} {_mode_label(c):<16}" + "".join(cells))
        lines.append("")
    reasons: Dict[str, List[str]] = {}
    for c in report["cases"]:
        for k, why in c["skipped"].items():
            reasons.setdefault(why, []).append(f"{c['tokens']}x{c['hidden']} {k}")
    for why, where in reasons.items():
        shown = ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")
        lines.append(f"skipped {shown}: {why}")
    return "\n".join(lines).rstrip() + "\n"


def _mode_label(case: dict) -> str:
    """The mode that ran; "(forced)" when --modes forced it rather than the policy."""
    mode = case["mode"] or "-"
    policy = case.get("policy", "auto")
    return mode if policy == "auto" else f"{mode}(forced)"


# The plot's panels: ours (solid) against each baseline (dashed), in the colour of the
# hidden size.
PAIRS = (
    ("ours", "anchor"),
    ("ours", "nccl"),
    ("ours", "symm_mem"),
    ("ours_fp8", "anchor_fp8"),
    ("ours", "ours_no_timeout"),
)


def plot(report: dict, path: Path) -> bool:
    """us per call (the slowest rank's median) vs tokens: one row per eager/graph, one
    column per comparison (ours against the anchor, NCCL, symmetric memory; FP8 ours against
    FlashInfer's; the wait timeout on against off). One colour per hidden size: ours solid,
    its baseline dashed in the same colour; a forced mode (--modes) by its marker. False
    without matplotlib."""
    plt = report_files.pyplot()
    if plt is None:
        return False
    variants = report["config"]["variants"]
    hows = sorted({k.split(":")[1] for k in variants}, key=HOWS.index)
    timed = {k.split(":")[0] for k in variants}
    pairs = [(a, b) for a, b in PAIRS if a in timed and b in timed]
    if not pairs:  # no baseline ran: a panel per variant
        pairs = [(i, None) for i in IMPLS if i in timed]
    hiddens = report["config"]["hidden"]
    colours = report_files.size_colours(plt, hiddens)
    markers = {"auto": "o", "oneshot": "^", "twoshot": "s"}
    policies = list(report["config"].get("modes", ["auto"]))
    fig, axes = plt.subplots(
        len(hows), len(pairs), squeeze=False, figsize=(max(6, 5 * len(pairs)), 4 * len(hows))
    )
    for row, how in enumerate(hows):
        for col, (ours, base) in enumerate(pairs):
            ax = axes[row][col]
            for hidden in hiddens:
                for policy in policies:
                    cases = [
                        c
                        for c in report["cases"]
                        if c["hidden"] == hidden and c.get("policy", "auto") == policy
                    ]
                    for impl, style in (
                        (ours, report_files.FUSED_STYLE),
                        (base, report_files.BASELINE_STYLE),
                    ):
                        if impl is None:
                            continue
                        pts = [
                            (c["tokens"], c["us"][f"{impl}:{how}"])
                            for c in cases
                            if f"{impl}:{how}" in c["us"]
                        ]
                        if pts:
                            mode = "" if len(policies) == 1 else f" ({policy})"
                            ax.plot(
                                *zip(*pts),
                                style,
                                color=colours[hidden],
                                marker=markers[policy],
                                label=f"{impl}{mode}, hidden {hidden}",
                            )
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="tokens",
                ylabel="us per call (median)",
                title=f"{how}: {ours}" + (f" vs {base}" if base else ""),
            )
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="x-small")
    m, cfg = report["machine"], report["config"]
    fig.suptitle(
        f"torch, {cfg['world_size']} x {m.get('device_name', '?')}, {cfg['dtype']}, "
        f"torch {m.get('torch', '?')}",
        fontsize="medium",
    )
    report_files.save_figure(plt, fig, path)
    return True


# --------------------------------------------------------------------------------------------
# Per-rank driver (generic over a runtime, so the control flow runs on CPU in tests)
# --------------------------------------------------------------------------------------------


class Skip(Exception):
    """A variant that cannot run here; the message is recorded."""


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def run_cases(
    rt,
    cases: Sequence[Case],
    factories: Mapping[str, Callable],
    keys: Sequence[str],
    *,
    iters: int,
    repeats: int,
    warmup: int,
    progress=None,
) -> List[dict]:
    """Times every variant of every case on this rank. Collective: every rank runs the same
    cases and factories in the same order, and ``rt.agree`` makes a variant that fails to set
    up (or to capture) on any rank be skipped on all of them, so no rank waits alone.

    ``factories[impl](case)`` returns the call to time (raising to skip); ``rt`` provides
    ``agree(reason|None) -> reason|None`` (over all ranks), ``sync()``, ``time_eager(fn,
    iters, repeats)``, ``capture(fn, iters, warmup)``, ``time_graph(graph, iters, repeats)``
    and ``release(graph)``.
    """
    wanted = {}
    for k in keys:
        impl, how = k.split(":")
        wanted.setdefault(impl, []).append(how)
    out = []
    for case in cases:
        entry = {
            "tokens": case.tokens,
            "hidden": case.hidden,
            "mode": case.mode,
            "policy": case.policy,
            "us_repeats": {},
            "skipped": {},
        }
        out.append(entry)
        if case.oneshot is None:
            for k in keys:
                entry["skipped"][k] = case.skipped.get(k.split(":")[0], "infeasible")
            if progress:
                progress.update(len(keys))
            continue
        for impl, hows in wanted.items():
            if progress:
                progress.set_description(f"{case.tokens}x{case.hidden} {impl}")
            reason, fn = None, None
            try:  # host-side setup first, agreed before any rank launches a collective
                fn = factories[impl](case)
            except Exception as e:  # noqa: BLE001 (any failure skips the variant everywhere)
                reason = _reason(e)
            reason = rt.agree(reason)
            if not reason:
                try:
                    for _ in range(warmup):
                        fn()
                    rt.sync()
                except Exception as e:  # noqa: BLE001
                    reason = _reason(e)
                reason = rt.agree(reason)
            if reason:
                for how in hows:
                    entry["skipped"][f"{impl}:{how}"] = reason
                if progress:
                    progress.update(len(hows))
                continue
            if "eager" in hows:
                entry["us_repeats"][f"{impl}:eager"] = rt.time_eager(fn, iters, repeats)
                if progress:
                    progress.update(1)
            if "graph" in hows:
                graph, reason = None, None
                try:
                    graph = rt.capture(fn, iters, warmup)
                except Exception as e:  # noqa: BLE001
                    reason = "capture failed: " + _reason(e)
                reason = rt.agree(reason)
                if reason:
                    entry["skipped"][f"{impl}:graph"] = reason
                else:
                    entry["us_repeats"][f"{impl}:graph"] = rt.time_graph(graph, iters, repeats)
                rt.release(graph)
                if progress:
                    progress.update(1)
    return out


class CudaRuntime:
    """Timing with CUDA events; the host-side agreements and barriers over the gloo group."""

    def __init__(self, torch, dist, device: int):
        self.torch, self.dist, self.device = torch, dist, device
        self.world = dist.get_world_size()

    def agree(self, reason: Optional[str]) -> Optional[str]:
        gathered = [None] * self.world
        self.dist.all_gather_object(gathered, reason)
        bad = [(r, g) for r, g in enumerate(gathered) if g]
        return f"rank {bad[0][0]}: {bad[0][1]}" if bad else None

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def _start(self) -> None:
        self.sync()
        self.dist.barrier()  # every rank idle, then all start together

    def _events(self):
        Event = self.torch.cuda.Event
        return Event(enable_timing=True), Event(enable_timing=True)

    def time_eager(self, fn, iters: int, repeats: int) -> List[float]:
        times = []
        for _ in range(repeats):
            start, end = self._events()
            self._start()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        return times

    def capture(self, fn, iters: int, warmup: int):
        torch = self.torch
        # Warm up on a side stream first, as torch's CUDA-graph docs ask (NCCL and lazily
        # initialised libraries); every rank makes the same calls, so this is collective.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog's and other threads' CUDA calls during the capture
        # are theirs, not an error of this capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(iters):
                fn()
        self.sync()
        return graph

    def time_graph(self, graph, iters: int, repeats: int) -> List[float]:
        self._start()
        graph.replay()  # first replay uploads the graph
        times = []
        for _ in range(repeats):
            start, end = self._events()
            self._start()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        return times

    def release(self, graph) -> None:
        if graph is not None:
            self.sync()
            graph.reset()


# --------------------------------------------------------------------------------------------
# The variants (GPU)
# --------------------------------------------------------------------------------------------


class Variants:
    """Factories for every implementation; each builds its own tensors for a case and returns
    the call to time. Setup that spans cases (workspaces, groups, symmetric buffer) happens in
    ``setup``; what cannot be set up is recorded in ``notes`` and its variants skipped."""

    def __init__(self, torch, dist, args, rank: int, device: int, shared_gpu: bool):
        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.device, self.world = rank, device, args.world
        self.dev = torch.device("cuda", device)  # where the per-case tensors live
        self.dtype = getattr(torch, args.dtype)
        self.pdl = not args.no_pdl
        self.shared_gpu = shared_gpu
        self.notes: Dict[str, str] = {}
        self.unavailable: Dict[str, str] = {}
        self.ours_ws = self.anchor_ws = self.fi = None
        self.ours_off_ws = None
        self.nccl_group = None
        self.symm_buf = self.symm_group_name = None
        self.symm_op, self.symm_copy = None, False

    # --- setup (collective, in this order on every rank) ---

    def setup(self, rt) -> None:
        torch, dist, args = self.torch, self.dist, self.args
        max_tokens, max_hidden = max(args.tokens), max(args.hidden)
        import torch_compat as tc

        self.tc = tc
        self.ours_ws = tc.create_allreduce_fusion_workspace(
            "trtllm",
            world_size=self.world,
            rank=self.rank,
            max_token_num=max_tokens,
            hidden_dim=max_hidden,
            dtype=self.dtype,
            timeout_s=120,
        )
        self.notes["ours_workspace"] = repr(self.ours_ws)
        if getattr(args, "timeout_compare", False):
            self.ours_off_ws = tc.create_allreduce_fusion_workspace(
                "trtllm",
                world_size=self.world,
                rank=self.rank,
                max_token_num=max_tokens,
                hidden_dim=max_hidden,
                dtype=self.dtype,
                timeout_s=120,
                kernel_timeout_s=0,
            )
            self.notes["ours_timeout_s"] = str(self.ours_ws.timeout_s)

        if not args.no_anchor:
            reason, loader = None, anchor_loader()
            try:
                self.fi = loader.load_anchor(args.anchor)
                self.notes["anchor_module"] = getattr(self.fi, "__file__", "?")
            except loader.AnchorUnavailable as e:
                reason = str(e)
            reason = rt.agree(reason)
            if reason is None:
                try:
                    self.anchor_ws = loader.create_anchor_workspace(
                        self.fi,
                        world_size=self.world,
                        rank=self.rank,
                        max_token_num=max_tokens,
                        hidden_dim=max_hidden,
                        dtype=self.dtype,
                        group=dist.group.WORLD,
                    )
                except Exception as e:  # noqa: BLE001
                    reason = "creating FlashInfer's workspace failed: " + _reason(e)
                reason = rt.agree(reason)
            if reason:
                self.unavailable["anchor"] = self.unavailable["anchor_fp8"] = reason

        if not args.no_nccl:
            reason = None
            if self.shared_gpu:
                reason = "ranks share a GPU (NCCL needs one GPU per rank)"
            else:
                try:
                    self.nccl_group = dist.new_group(ranks=list(range(self.world)), backend="nccl")
                    probe = torch.ones(8, device=self.device)
                    dist.all_reduce(probe, group=self.nccl_group)  # creates the communicator
                    rt.sync()
                    if probe[0].item() != self.world:
                        reason = f"NCCL probe all_reduce gave {probe[0].item()}"
                except Exception as e:  # noqa: BLE001
                    reason = "NCCL setup failed: " + _reason(e)
            reason = rt.agree(reason)
            if reason:
                self.unavailable["nccl"] = reason

        if not args.no_symm_mem:
            reason = (
                self._setup_symm_mem(max_tokens * max_hidden)
                if not self.shared_gpu
                else "ranks share a GPU (symmetric memory needs one GPU per rank)"
            )
            reason = rt.agree(reason)
            if reason:
                self.unavailable["symm_mem"] = reason
                self.symm_buf = None

    def _setup_symm_mem(self, numel: int) -> Optional[str]:
        torch, dist = self.torch, self.dist
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as e:
            return f"torch.distributed._symmetric_memory is unavailable: {e}"
        ops = torch.ops.symm_mem
        try:  # copy variant: the local input goes into the symmetric buffer in-kernel
            self.symm_op, self.symm_copy = ops.one_shot_all_reduce_copy_out, True
        except (AttributeError, RuntimeError):
            try:
                self.symm_op = ops.one_shot_all_reduce_out
            except (AttributeError, RuntimeError) as e:
                return f"torch.ops.symm_mem has no one-shot all-reduce: {_reason(e)}"
        notes = []
        try:
            symm_mem.set_backend("CUDA")  # never NVSHMEM (own NVLS handling) nor NCCL
            notes.append("backend CUDA")
        except Exception as e:  # noqa: BLE001 (older torch: CUDA is the only backend)
            notes.append(f"set_backend('CUDA') not applied ({_reason(e)})")
        group_name = dist.group.WORLD.group_name
        if _torch_version(torch) < (2, 11):
            # Before 2.11 a group had to be registered; 2.11 deprecated it (the C++ side
            # resolves the group's store itself) and registering twice is an error.
            import warnings

            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    symm_mem.enable_symm_mem_for_group(group_name)
            except Exception as e:  # noqa: BLE001
                notes.append(f"enable_symm_mem_for_group: {_reason(e)}")
        try:
            self.symm_buf = symm_mem.empty(numel, dtype=self.dtype, device=f"cuda:{self.device}")
            symm_mem.rendezvous(self.symm_buf, group_name)
            self.symm_group_name = group_name
        except Exception as e:  # noqa: BLE001
            return "symmetric-memory allocation or rendezvous failed: " + _reason(e)
        notes.append(f"op {self.symm_op}")
        self.notes["symm_mem"] = "; ".join(notes)
        return None

    def factories(self) -> Dict[str, Callable]:
        all_ = {
            "ours": self.ours,
            "anchor": self.anchor,
            "nccl": self.nccl,
            "symm_mem": self.symm_mem,
            "ours_fp8": self.ours_fp8,
            "anchor_fp8": self.anchor_fp8,
        }
        if getattr(self.args, "timeout_compare", False):
            all_["ours_no_timeout"] = self.ours_no_timeout
        return {k: (self._unavailable(k) if k in self.unavailable else f) for k, f in all_.items()}

    def _unavailable(self, impl):
        def factory(case):
            raise Skip(self.unavailable[impl])

        return factory

    # --- per-case tensors ---

    def _inputs(self, case: Case):
        torch = self.torch
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(self.args.seed * 1000003 + case.tokens * 131 + case.hidden * 7 + self.rank)
        shape = (case.tokens, case.hidden)

        def randn(*s):
            return torch.randn(*s, generator=gen, device=self.dev, dtype=torch.float32).to(
                self.dtype
            )

        x, residual = randn(*shape), randn(*shape)
        gamma = 1 + 0.1 * randn(case.hidden)
        outs = [torch.empty(shape, dtype=self.dtype, device=self.dev) for _ in range(3)]
        return x, residual, gamma.to(self.dtype), outs

    def _fp8(self, case: Case):
        torch = self.torch
        quant = torch.empty((case.tokens, case.hidden), dtype=torch.float8_e4m3fn, device=self.dev)
        # RMSNorm outputs of N(0,1) rows with gamma ~ 1 stay within +-8: no saturation.
        scale = torch.tensor([8.0 / FP8_MAX], dtype=torch.float32, device=self.dev)
        return quant, scale

    def _ours_with_workspace(self, case: Case, ws):
        x, residual, gamma, (res_out, norm_out, _) = self._inputs(case)
        tc = self.tc
        kw = dict(
            input=x,
            workspace=ws,
            pattern=NORM_PATTERN,
            launch_with_pdl=self.pdl,
            residual_out=res_out,
            norm_out=norm_out,
            residual_in=residual,
            rms_gamma=gamma,
            rms_eps=RMS_EPS,
            use_oneshot=case.oneshot,
            fp32_acc=True,
        )
        return lambda: tc.allreduce_fusion(**kw)

    def ours(self, case: Case):
        return self._ours_with_workspace(case, self.ours_ws)

    def ours_no_timeout(self, case: Case):
        """The same call on the workspace with the kernel's wait timeout off."""
        return self._ours_with_workspace(case, self.ours_off_ws)

    def ours_fp8(self, case: Case):
        x, residual, gamma, (res_out, norm_out, _) = self._inputs(case)
        quant, scale = self._fp8(case)
        tc, ws = self.tc, self.ours_ws
        kw = dict(
            input=x,
            workspace=ws,
            pattern=FP8_PATTERN,
            launch_with_pdl=self.pdl,
            residual_out=res_out,
            norm_out=norm_out,
            quant_out=quant,
            residual_in=residual,
            rms_gamma=gamma,
            rms_eps=RMS_EPS,
            scale_factor=scale,
            use_oneshot=case.oneshot,
            fp32_acc=True,
        )
        return lambda: tc.allreduce_fusion(**kw)

    def anchor(self, case: Case):
        x, residual, gamma, (res_out, norm_out, scratch) = self._inputs(case)
        fi, ws = self.fi, self.anchor_ws
        kw = dict(
            input=x,
            workspace=ws,
            pattern=NORM_PATTERN,
            launch_with_pdl=self.pdl,
            output=scratch,
            residual_out=res_out,
            norm_out=norm_out,
            residual_in=residual,
            rms_gamma=gamma,
            rms_eps=RMS_EPS,
            use_oneshot=case.oneshot,
            fp32_acc=True,
        )
        return lambda: fi.allreduce_fusion(**kw)

    def anchor_fp8(self, case: Case):
        x, residual, gamma, (res_out, norm_out, scratch) = self._inputs(case)
        quant, scale = self._fp8(case)
        fi, ws = self.fi, self.anchor_ws
        kw = dict(
            input=x,
            workspace=ws,
            pattern=FP8_PATTERN,
            launch_with_pdl=self.pdl,
            output=scratch,
            residual_out=res_out,
            norm_out=norm_out,
            quant_out=quant,
            residual_in=residual,
            rms_gamma=gamma,
            rms_eps=RMS_EPS,
            scale_factor=scale,
            use_oneshot=case.oneshot,
            fp32_acc=True,
        )
        return lambda: fi.allreduce_fusion(**kw)

    def _add_rmsnorm(self, reduced, residual, gamma, res_out):
        torch = self.torch
        F = torch.nn.functional
        hidden = reduced.shape[-1]

        def epilogue():
            torch.add(reduced, residual, out=res_out)
            return F.rms_norm(res_out, (hidden,), gamma, RMS_EPS)

        return epilogue

    def nccl(self, case: Case):
        x, residual, gamma, (res_out, _, _) = self._inputs(case)
        dist, group = self.dist, self.nccl_group
        epilogue = self._add_rmsnorm(x, residual, gamma, res_out)

        def call():
            dist.all_reduce(x, group=group)  # in place, as a TP layer does
            return epilogue()

        return call

    def symm_mem(self, case: Case):
        x, residual, gamma, (res_out, reduced, _) = self._inputs(case)
        n = case.tokens * case.hidden
        buf = self.symm_buf[:n].view(case.tokens, case.hidden)
        op, group_name = self.symm_op, self.symm_group_name
        epilogue = self._add_rmsnorm(reduced, residual, gamma, res_out)
        if self.symm_copy:

            def call():
                op(buf, x, "sum", group_name, reduced)
                return epilogue()
        else:  # older torch: copy into the symmetric buffer first

            def call():
                buf.copy_(x)
                op(buf, "sum", group_name, reduced)
                return epilogue()

        return call

    def teardown(self, rt) -> None:
        rt.sync()
        self.dist.barrier()  # no rank frees while a peer may still use its buffers
        if self.anchor_ws is not None:
            self.anchor_ws.destroy()
        if self.ours_ws is not None:
            self.ours_ws.destroy()
        if self.ours_off_ws is not None:
            self.ours_off_ws.destroy()
        self.symm_buf = None
        if self.nccl_group is not None:
            self.dist.destroy_process_group(self.nccl_group)
        self.dist.barrier()


def _torch_version(torch) -> tuple:
    parts = []
    for p in torch.__version__.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _machine(torch, device: int) -> dict:
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001
        nccl = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "device_name": torch.cuda.get_device_name(device),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "gpus_visible": torch.cuda.device_count(),
        "env": {
            k: os.environ.get(k)
            for k in (*SAFE_ENV, "JAX_FUSEDAR_HANDSHAKE", "CUDA_VISIBLE_DEVICES")
        },
    }


def _worker(rank: int, args, port: int, result_dir: str) -> None:
    """One rank: joins the groups, sets up every implementation, times every case, writes
    ``rank<r>.json`` to ``result_dir``."""
    os.environ.update(SAFE_ENV)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise RuntimeError("torch sees no CUDA GPU in the benchmark process")
    device = rank % gpus
    torch.cuda.set_device(device)  # torch_compat takes torch.cuda.current_device()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        rt = CudaRuntime(torch, dist, device)
        _, cases = plan_cases(args.tokens, args.hidden, args.dtype, args.world, args.modes)
        keys = variant_keys(args)
        variants = Variants(torch, dist, args, rank, device, shared_gpu=gpus < args.world)
        variants.setup(rt)
        progress = (
            report_files.progress_bar(len(cases) * len(keys), "timing") if rank == 0 else None
        )
        try:
            results = run_cases(
                rt,
                cases,
                variants.factories(),
                keys,
                iters=args.iters,
                repeats=args.repeats,
                warmup=args.warmup,
                progress=progress,
            )
        finally:
            if progress:
                progress.close()
        variants.teardown(rt)
        payload = {
            "rank": rank,
            "device": device,
            "machine": _machine(torch, device),
            "notes": {
                **variants.notes,
                **{f"unavailable {k}": v for k, v in variants.unavailable.items()},
            },
            "cases": results,
        }
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(payload))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: Callable, world: int, worker_args: tuple, timeout_s: float) -> None:
    """Runs ``worker(rank, *worker_args)`` in ``world`` spawned processes. A rank that raises
    ends the others (torch.multiprocessing's ProcessContext) and its traceback is raised
    here; past ``timeout_s`` every process is killed and TimeoutError raised."""
    import torch.multiprocessing as tmp

    ctx = tmp.spawn(worker, args=worker_args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=10)
            raise TimeoutError(
                f"ranks {alive} still running after {timeout_s:.0f} s (a kernel "
                "waiting for a peer never returns); killed them"
            )


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
    args = parse_args(argv, prog)
    os.environ.update(SAFE_ENV)
    anchor = {"requested": not args.no_anchor, "path": None, "problem": None}
    if not args.no_anchor:
        loader = anchor_loader()
        path = loader.resolve_anchor_path(args.anchor)
        anchor["path"] = str(path)
        anchor["problem"] = loader.anchor_problem(path)
        args.anchor = str(path)
        if anchor["problem"]:
            print(
                f"note: {loader.unavailable(path, anchor['problem'])} Its rows are skipped.",
                file=sys.stderr,
            )
        else:
            # Before spawning: the ranks inherit them (LD_LIBRARY_PATH only works that way).
            os.environ.update(loader.anchor_environment(path))
    try:
        import torch
    except ImportError:
        print(f"{prog}: error: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            f"{prog}: error: needs CUDA GPUs (torch {torch.__version__} sees none)", file=sys.stderr
        )
        return 2
    if torch.cuda.device_count() < args.world:
        gpus = torch.cuda.device_count()
        print(
            f"{prog}: error: --world {args.world} needs one GPU per rank and this machine "
            f"has {gpus}: ranks sharing a GPU take turns on it, so a timing measures that "
            "scheduling, not the kernel",
            file=sys.stderr,
        )
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes, cases = plan_cases(args.tokens, args.hidden, args.dtype, args.world, args.modes)
    print(
        f"{prog}: {args.world} ranks, {args.dtype}, {len(cases)} cases x "
        f"{len(variant_keys(args))} variants; workspace {sizes.max_token_num} x "
        f"{sizes.hidden_dim} ({sizes.per_rank_bytes / 2**20:.0f} MiB per rank)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench_torch_") as tmp:
        launch(_worker, args.world, (args, _free_port(), tmp), args.timeout)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]
    machine = {
        **ranks[0]["machine"],
        "world_size": args.world,
        "devices": [r["device"] for r in ranks],
    }
    report = build_report(ranks, args, machine, anchor)
    print()
    print(format_table(report), end="")
    for r, notes in enumerate(report["rank_notes"]):
        for k, v in notes.items():
            if r == 0 or k.startswith("unavailable"):
                print(f"rank {r} {k}: {v}")
    report_files.write_results(out_dir, "bench_torch", report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
