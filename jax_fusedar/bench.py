"""``python -m jax_fusedar bench``: latency of the fused op vs psum + residual add + RMSNorm.

Each measurement is one jitted ``lax.fori_loop`` of ``iters`` calls inside shard_map, timed
with ``time.perf_counter`` around ``block_until_ready`` after a warm-up call; the per-call
time is total / iters and the reported figure the median over ``repeats`` loops. The
baseline runs the identical loop with ``demo.plain_add_rmsnorm`` (psum + add + RMSNorm in
plain jnp) in the same process, so the two are directly comparable.
"""
from __future__ import annotations

import json
import math
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import topology
from .api import allreduce_fusion
from .demo import (AXIS, RMS_EPS, check_supported, describe_devices, open_workspace,
                   plain_add_rmsnorm, timed_runs, tp_mesh)

USE_ONESHOT = {"auto": None, "oneshot": True, "twoshot": False}


def reference_banner(device_kind: str) -> str:
    return ("NOTE: backend 'xla': these numbers time XLA's reference path (psum + residual add "
            f"+ RMSNorm) on {device_kind}, NOT the FlashInfer kernel; 'fused' and the mode "
            "column only say what the kernel would run.")


def chosen_mode(tokens: int, hidden: int, sizes, mode: str):
    """("oneshot" | "twoshot", None) as allreduce_fusion would launch, or (None, reason) when
    the requested mode cannot run. The same decision function the op itself calls."""
    try:
        oneshot = topology.choose_oneshot(tokens, hidden, sizes, USE_ONESHOT[mode])
    except ValueError as e:
        return None, str(e)
    return ("oneshot" if oneshot else "twoshot"), None


def looped(combine, iters: int):
    """Per-rank body: ``iters`` calls of ``combine(x, residual, gamma)`` in a fori_loop."""
    def body(x, residual, gamma):
        def step(i, carry):
            x, residual, _ = carry
            # psum(x) does not depend on the carry, so XLA could hoist the baseline's
            # all-reduce out of the loop; passing x through a barrier together with the loop
            # index makes it loop-variant at no runtime cost.
            x, _ = jax.lax.optimization_barrier((x, i))
            residual, norm = combine(x, residual, gamma)
            # norm is carried to the loop's result so that no iteration's norm is dead code.
            return x, residual, norm
        _, residual, norm = jax.lax.fori_loop(0, iters, step,
                                              (x[0], residual, jnp.zeros_like(residual)))
        return residual, norm
    return body


def per_call_seconds(loop, inputs, iters: int, repeats: int) -> list:
    """Per-call seconds of each of ``repeats`` runs of a loop of ``iters`` calls."""
    return [t / iters for t in timed_runs(loop, inputs, repeats)]


class _StderrBar:
    """The progress bar when tqdm is not installed: one redrawn line on stderr."""

    def __init__(self, total: int):
        self.total, self.n, self.desc = total, 0, ""

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self._draw()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw()

    def close(self) -> None:
        sys.stderr.write("\n")

    def _draw(self) -> None:
        width = 30
        done = width * self.n // self.total
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} "
                         f"{self.desc:<40}")
        sys.stderr.flush()


def progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _StderrBar(total)
    return tqdm(total=total, unit="loop", file=sys.stderr)


def plot(report: dict, path: Path) -> bool:
    """Latency vs tokens, one log-log panel per hidden size; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # write a file; never needs a display
    import matplotlib.pyplot as plt

    hiddens = report["config"]["hidden"]
    fig, axes = plt.subplots(1, len(hiddens), figsize=(max(6, 5 * len(hiddens)), 4.5),
                             squeeze=False)
    for ax, hidden in zip(axes[0], hiddens):
        cases = [c for c in report["cases"] if c["hidden"] == hidden]
        ax.plot([c["tokens"] for c in cases], [c["baseline_us"] for c in cases], "k--o",
                label="psum + add + RMSNorm")
        for mode in report["config"]["modes"]:
            points = [(c["tokens"], c["fused"][mode]["us"]) for c in cases if mode in c["fused"]]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"fused ({mode})")
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per call",
               title=f"hidden {hidden}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    machine = report["machine"]
    title = (f"{machine['device_count']} x {machine['device_kind']}, {report['config']['dtype']}, "
             f"backend {machine['backend']}")
    if machine["backend"] == "xla":
        title += "\nXLA reference path, not the kernel"
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _machine_info(world: int, backend: str) -> dict:
    d = jax.devices()[0]
    return {"jax_version": jax.__version__, "jaxlib_version": jax.lib.__version__,
            "python": platform.python_version(), "hostname": socket.gethostname(),
            "platform": d.platform, "device_kind": d.device_kind,
            "device_count": jax.device_count(), "world_size": world, "backend": backend}


def _print_table(report: dict) -> None:
    print(f"{'tokens':>7} {'hidden':>7}  {'mode':<16} {'fused us':>10} {'baseline us':>12} "
          f"{'fused/baseline':>15}")
    notes = []
    for case in report["cases"]:
        for mode in report["config"]["modes"]:
            if mode in case["skipped"]:
                notes.append(f"{case['tokens']} x {case['hidden']} {mode}: "
                             f"{case['skipped'][mode]}")
                continue
            m = case["fused"][mode]
            label = f"auto ({m['chosen']})" if mode == "auto" else mode
            print(f"{case['tokens']:>7} {case['hidden']:>7}  {label:<16} {m['us']:>10.2f} "
                  f"{case['baseline_us']:>12.2f} {m['ratio']:>15.3f}")
    for note in notes:
        print(f"skipped {note}")


def main(args) -> int:
    mesh = tp_mesh()
    world = mesh.shape[AXIS]
    check_supported(world, args.hidden, args.dtype)
    dtype = jnp.dtype(args.dtype)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

    with open_workspace(mesh, max_token_num=max(args.tokens), hidden_dim=max(args.hidden),
                        dtype=dtype, backend=args.backend) as ws:
        machine = _machine_info(world, ws.backend)
        banner = reference_banner(machine["device_kind"]) if ws.backend == "xla" else None
        print(describe_devices(world, ws.backend))

        def shard_loop(combine):
            return jax.jit(jax.shard_map(looped(combine, args.iters), mesh=mesh,
                                         in_specs=(P(AXIS), P(), P()), out_specs=(P(), P())))

        def fused(use_oneshot):
            def combine(x, residual, gamma):
                out = allreduce_fusion(x, axis_name=AXIS, workspace=ws, residual=residual,
                                       rms_gamma=gamma, rms_eps=RMS_EPS, use_oneshot=use_oneshot)
                return out.residual_out, out.norm_out
            return shard_loop(combine)

        baseline = shard_loop(plain_add_rmsnorm)
        fused_loops = {mode: fused(USE_ONESHOT[mode]) for mode in args.modes}

        plan = []  # (tokens, hidden, {mode: chosen}, {mode: reason})
        for tokens in args.tokens:
            for hidden in args.hidden:
                runnable, skipped = {}, {}
                for mode in args.modes:
                    chosen, reason = chosen_mode(tokens, hidden, ws.sizes, mode)
                    if reason:
                        skipped[mode] = reason
                    else:
                        runnable[mode] = chosen
                plan.append((tokens, hidden, runnable, skipped))

        cases = []
        bar = progress_bar(sum(1 + len(runnable) for _, _, runnable, _ in plan))
        try:
            for tokens, hidden, runnable, skipped in plan:
                # Partial sums scaled by 1/iters: the loop adds their sum to the residual
                # every call, which then stays O(1) however many calls run (no fp16 overflow).
                x = (rng.standard_normal((world, tokens, hidden), dtype=np.float32)
                     / np.float32(math.sqrt(world) * args.iters))
                residual = rng.standard_normal((tokens, hidden), dtype=np.float32)
                gamma = 1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)
                inputs = (jax.device_put(x.astype(dtype), split),
                          jax.device_put(residual.astype(dtype), replicated),
                          jax.device_put(gamma.astype(dtype), replicated))
                bar.set_description(f"{tokens}x{hidden} baseline")
                base = per_call_seconds(baseline, inputs, args.iters, args.repeats)
                bar.update()
                case = {"tokens": tokens, "hidden": hidden,
                        "baseline_us": statistics.median(base) * 1e6,
                        "baseline_us_repeats": [t * 1e6 for t in base],
                        "fused": {}, "skipped": skipped}
                for mode, chosen in runnable.items():
                    bar.set_description(f"{tokens}x{hidden} fused {mode}")
                    times = per_call_seconds(fused_loops[mode], inputs, args.iters, args.repeats)
                    bar.update()
                    us = statistics.median(times) * 1e6
                    case["fused"][mode] = {"chosen": chosen, "us": us,
                                           "us_repeats": [t * 1e6 for t in times],
                                           "ratio": us / case["baseline_us"]}
                cases.append(case)
        finally:
            bar.close()

    report = {
        "machine": machine,
        "config": {"dtype": args.dtype, "iters": args.iters, "repeats": args.repeats,
                   "tokens": args.tokens, "hidden": args.hidden, "modes": args.modes,
                   "max_token_num": max(args.tokens), "hidden_dim": max(args.hidden),
                   "rms_eps": RMS_EPS,
                   "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "reference_path": machine["backend"] == "xla",
        "method": "per-call time = (lax.fori_loop of iters calls) / iters, median over repeats",
        "cases": cases,
    }
    print()
    if banner:
        print(banner)
    _print_table(report)
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {json_path}")
    png_path = out_dir / "bench.png"
    if plot(report, png_path):
        print(f"wrote {png_path}")
    else:
        print(f"note: matplotlib is not installed, so no {png_path} "
              "(pip install matplotlib to get the plot)")
    return 0
