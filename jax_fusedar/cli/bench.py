"""``python -m jax_fusedar bench``: latency of the fused op vs the unfused XLA ops.

Three timing methods, each with the baseline in the same process and run:

* ``device`` (the default on GPUs): one jitted program of K = ``--chain`` dependent calls
  (as in ``chain`` below) bracketed by device-clock stamps (``timing.device_timestamp``) on
  every GPU, ordered by data dependencies, so the figure is what the GPUs spent, not how
  fast the host dispatched: the program's device time / K, for the slower device, median
  over ``--repeats``. Gaps the host leaves between kernels count, as in a model, and so
  does the first call's wait for the other GPU to start (spread over K calls, so the
  figure errs on the slow side). A difference of two program lengths would remove that
  wait but, measured on 2 x H200, the start skew varies by tens of microseconds between
  runs, which made the difference noisier than the wait it removes.
* ``chain`` (the default elsewhere): the same program of K dependent calls, each call's
  input being the previous call's norm output (a real dependency, as between the layers of a
  model, so XLA can neither reorder nor combine the baseline's all-reduces), timed by the
  host clock around the whole program: wall time / K, median over ``--repeats``. Includes
  the host's dispatch of the program, spread over K calls.
* ``loop``: a ``lax.fori_loop`` of ``--iters`` calls on the same input (the method of the
  yardsticks in docs/benchmarks.md). XLA's while loop syncs with the host every iteration, which
  adds the same few microseconds to both columns.

``--timeout-compare`` times every fused case with the workspace's wait timeout
(``timeout_s``, always on by default) and with it off (``set_timeout(0)``, FlashInfer's
spin-forever waits), TIMEOUT_ROUNDS alternating rounds each on the same workspace and
compiled program, and prints the medians and their ratio.

Patterns: 1 (all-reduce + residual + RMSNorm) against ``psum`` + add + RMSNorm in plain jnp;
the FP8 patterns 4 (static), 11 (dynamic per token) and 9 (per-token group, 128) against the
same plus the matching FP8 quantization written in XLA (``quant_reference``, which XLA fuses
into the norm's kernel).
"""

from __future__ import annotations

import math
import platform
import socket
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import quant_reference, timing
from ..api import allreduce_fusion
from ..common import launch_mode, limits
from ..common.patterns import AllReduceFusionPattern as Pattern
from . import report as report_files
from .compare import plain_add_rmsnorm, timed_runs
from .setup import (
    AXIS,
    RMS_EPS,
    SetupError,
    check_supported,
    describe_devices,
    open_workspace,
    tp_mesh,
)

USE_ONESHOT = {"auto": None, "oneshot": True, "twoshot": False}
GROUP_SIZE = 128
# Patterns the bench knows how to time, with the label of their unfused XLA twin.
PATTERN_LABELS = {
    int(Pattern.kARResidualRMSNorm): "psum + add + RMSNorm",
    int(Pattern.kARResidualRMSNormOutFP8Quant): "... + static FP8",
    int(Pattern.kARResidualRMSNormOutDynamicFP8Quant): "... + dynamic FP8",
    int(
        Pattern.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant
    ): f"... + group FP8 ({GROUP_SIZE})",
}


def reference_banner(device_kind: str) -> str:
    return (
        "NOTE: backend 'xla': these numbers time XLA's reference path (psum + residual add "
        f"+ RMSNorm) on {device_kind}, NOT the FlashInfer kernel; 'fused' and the mode "
        "column only say what the kernel would run."
    )


def chosen_mode(tokens: int, hidden: int, sizes, mode: str):
    """("oneshot" | "twoshot" | "large", None) as allreduce_fusion would launch, or (None,
    reason) when the requested mode cannot run. The same decision function the op itself
    calls; "oneshot" and "twoshot" force FlashInfer's kernels, "auto" may pick the
    large-message algorithm."""
    try:
        algorithm = launch_mode.choose_algorithm(tokens, hidden, sizes, USE_ONESHOT[mode])
    except ValueError as e:
        return None, str(e)
    return launch_mode.ALGORITHM_NAMES[algorithm], None


def large_message_crossover(hidden: int, report: dict):
    """Fewest tokens from which auto picks the large-message algorithm at this hidden size
    (for the plot), or None where the world size has no measured threshold."""
    min_mib = launch_mode.LARGE_MESSAGE_MIN_MIB.get(report["machine"]["world_size"])
    if min_mib is None:
        return None
    row_bytes = hidden * limits.element_size(report["config"]["dtype"])
    return -(-min_mib * (1 << 20) // row_bytes)


def fused_combine(ws, pattern: int, use_oneshot):
    """combine(x, residual, gamma, scale) -> (residual_out, norm_out, quantized outputs)."""
    quant = {}
    if pattern == Pattern.kARResidualRMSNormOutFP8Quant:
        quant = {"scale_factor": None}
    elif pattern == Pattern.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant:
        quant = {"block_quant_group_size": GROUP_SIZE}

    def combine(x, residual, gamma, scale):
        kw = dict(quant)
        if "scale_factor" in kw:
            kw["scale_factor"] = scale
        out = allreduce_fusion(
            x,
            axis_name=AXIS,
            workspace=ws,
            pattern=pattern,
            residual=residual,
            rms_gamma=gamma,
            rms_eps=RMS_EPS,
            use_oneshot=use_oneshot,
            **kw,
        )
        extra = tuple(v for v in (out.quant_out, out.scale_out) if v is not None)
        return out.residual_out, out.norm_out, extra

    return combine


def baseline_combine(pattern: int):
    """The unfused twin of ``fused_combine``: psum + add + RMSNorm (+ the FP8 quantization)."""

    def combine(x, residual, gamma, scale):
        residual, norm = plain_add_rmsnorm(x, residual, gamma)
        q = quant_reference.quantize_for_pattern(
            norm, pattern, scale_factor=scale, group_size=GROUP_SIZE
        )
        return residual, norm, tuple(v for v in q if v is not None)

    return combine


def chained(combine, calls: int):
    """Per-rank body: ``calls`` calls, each fed the previous call's norm output as its partial
    sum. Every call's quantized outputs are returned, so none is dead code."""

    def body(x, residual, gamma, scale):
        x = x[0]
        extras = []
        for _ in range(calls):
            residual, norm, extra = combine(x, residual, gamma, scale)
            extras.append(extra)
            # norm is invariant over the axis; the next all-reduce takes a per-rank partial.
            x = jax.lax.pcast(norm, AXIS, to="varying")
        return residual, norm, extras

    return body


def looped(combine, iters: int):
    """Per-rank body: ``iters`` calls of ``combine`` on the same input in a fori_loop."""

    def body(x, residual, gamma, scale):
        def step(i, carry):
            x, residual, _ = carry
            # psum(x) does not depend on the carry, so XLA could hoist the baseline's
            # all-reduce out of the loop; passing x through a barrier together with the loop
            # index makes it loop-variant at no runtime cost.
            x, _ = jax.lax.optimization_barrier((x, i))
            residual, norm, _ = combine(x, residual, gamma, scale)
            # norm is carried to the loop's result so that no iteration's norm is dead code.
            return x, residual, norm

        _, residual, norm = jax.lax.fori_loop(
            0, iters, step, (x[0], residual, jnp.zeros_like(residual))
        )
        return residual, norm

    return body


def per_call_seconds(loop, inputs, iters: int, repeats: int) -> list:
    """Per-call seconds of each of ``repeats`` runs of a loop of ``iters`` calls."""
    return [t / iters for t in timed_runs(loop, inputs, repeats)]


def device_seconds(program, inputs, repeats: int) -> float:
    """Median over ``repeats`` runs (after a warm-up) of the device time between a program's
    two stamps, for the slower device."""
    jax.block_until_ready(program(*inputs))
    spans = []
    for _ in range(repeats):
        t0, t1 = program(*inputs)[:2]
        spans.append(float(np.max(timing.stamps_to_ns(t1) - timing.stamps_to_ns(t0))) * 1e-9)
    return statistics.median(spans)


def stamped(body):
    """Wraps a per-rank body so that it returns (start stamp, end stamp, body's outputs...):
    the start stamp passes x through to the first call, the end stamp follows the norm of
    the last call (which follows its residual)."""

    def wrapped(x, residual, gamma, scale):
        t0, x = timing.device_timestamp(x)
        residual, norm, extras = body(x, residual, gamma, scale)
        t1, norm = timing.device_timestamp(norm)
        return t0[None], t1[None], residual, norm, extras

    return wrapped


def plot(report: dict, path: Path) -> bool:
    """Latency vs tokens, one log-log panel per hidden size; False without matplotlib.
    One colour per series: the unfused XLA twins dashed, the fused op solid (one series per
    pattern and mode); a dotted line marks where auto switches to the large-message path."""
    plt = report_files.pyplot()
    if plt is None:
        return False
    hiddens = report["config"]["hidden"]
    fig, axes = plt.subplots(1, len(hiddens), figsize=(max(6, 6 * len(hiddens)), 5), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = {"auto": "o", "oneshot": "^", "twoshot": "s"}
    for ax, hidden in zip(axes[0], hiddens):
        series = 0
        for pattern in report["config"]["patterns"]:
            cases = [
                c for c in report["cases"] if c["hidden"] == hidden and c["pattern"] == pattern
            ]
            ax.plot(
                [c["tokens"] for c in cases],
                [c["baseline_us"] for c in cases],
                "--",
                color=colours[series % len(colours)],
                marker="x",
                label=f"XLA: {PATTERN_LABELS[pattern]}",
            )
            series += 1
            for mode in report["config"]["modes"]:
                points = [
                    (c["tokens"], c["fused"][mode]["us"]) for c in cases if mode in c["fused"]
                ]
                if points:
                    ax.plot(
                        *zip(*points),
                        "-",
                        color=colours[series % len(colours)],
                        marker=markers[mode],
                        label=f"fused pattern {pattern} ({mode})",
                    )
                    series += 1
        crossover = large_message_crossover(hidden, report)
        if crossover is not None and "auto" in report["config"]["modes"]:
            ax.axvline(
                crossover,
                linestyle=":",
                color="grey",
                label=f"auto: large-message from {crossover} tokens",
            )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="tokens",
            ylabel="us per call",
            title=f"hidden {hidden}",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="x-small")
    machine = report["machine"]
    title = (
        f"{machine['device_count']} x {machine['device_kind']}, {report['config']['dtype']}, "
        f"backend {machine['backend']}, method {report['config']['method']}"
    )
    if machine["backend"] == "xla":
        title += "\nXLA reference path, not the kernel"
    fig.suptitle(title, fontsize="medium")
    report_files.save_figure(plt, fig, path)
    return True


def _machine_info(world: int, backend: str) -> dict:
    d = jax.devices()[0]
    return {
        "jax_version": jax.__version__,
        "jaxlib_version": jax.lib.__version__,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "platform": d.platform,
        "device_kind": d.device_kind,
        "device_count": jax.device_count(),
        "world_size": world,
        "backend": backend,
    }


def _print_table(report: dict) -> None:
    print(
        f"{'pattern':>7} {'tokens':>7} {'hidden':>7}  {'mode':<16} {'fused us':>10} "
        f"{'XLA us':>10} {'fused/XLA':>10}"
    )
    notes = []
    for case in report["cases"]:
        for mode in report["config"]["modes"]:
            if mode in case["skipped"]:
                notes.append(
                    f"pattern {case['pattern']} {case['tokens']} x {case['hidden']} "
                    f"{mode}: {case['skipped'][mode]}"
                )
                continue
            m = case["fused"][mode]
            label = f"auto ({m['chosen']})" if mode == "auto" else mode
            print(
                f"{case['pattern']:>7} {case['tokens']:>7} {case['hidden']:>7}  {label:<16} "
                f"{m['us']:>10.2f} {case['baseline_us']:>10.2f} {m['ratio']:>10.3f}"
            )
    for note in notes:
        print(f"skipped {note}")
    print(
        "XLA twins: "
        + "; ".join(f"pattern {p}: {PATTERN_LABELS[p]}" for p in report["config"]["patterns"])
    )


# The budget the bounded waits must stay within: 1% or 0.1 us, whichever is larger.
TIMEOUT_BUDGET_REL = 0.01
TIMEOUT_BUDGET_US = 0.1
# On/off rounds per case (each a median over --repeats programs); the medians are compared.
TIMEOUT_ROUNDS = 3


def timeout_compare(on_us: float, off_us: float, timeout_s: float) -> dict:
    """The JSON entry of one on/off pair: both times, on/off ratio, and whether the cost is
    within the budget (1% or 0.1 us, whichever is larger)."""
    budget = max(TIMEOUT_BUDGET_REL * off_us, TIMEOUT_BUDGET_US)
    return {
        "timeout_s": timeout_s,
        "timeout_on_us": on_us,
        "no_timeout_us": off_us,
        "timeout_ratio": on_us / off_us if off_us > 0 else float("nan"),
        "timeout_within_budget": on_us - off_us <= budget,
    }


def _print_timeout_table(report: dict) -> None:
    rows = [
        (case, mode, case["fused"][mode])
        for case in report["cases"]
        for mode in report["config"]["modes"]
        if "no_timeout_us" in case["fused"].get(mode, {})
    ]
    if not rows:
        return
    print(
        f"\nwait timeout on vs off (budget: {TIMEOUT_BUDGET_REL:.0%} or "
        f"{TIMEOUT_BUDGET_US} us, whichever is larger)"
    )
    print(
        f"{'pattern':>7} {'tokens':>7} {'hidden':>7}  {'mode':<16} {'on us':>9} {'off us':>9} "
        f"{'on/off':>8} {'ok':>4}"
    )
    for case, mode, m in rows:
        label = f"auto ({m['chosen']})" if mode == "auto" else mode
        print(
            f"{case['pattern']:>7} {case['tokens']:>7} {case['hidden']:>7}  {label:<16} "
            f"{m['timeout_on_us']:>9.2f} {m['no_timeout_us']:>9.2f} {m['timeout_ratio']:>8.4f} "
            f"{'yes' if m['timeout_within_budget'] else 'NO':>4}"
        )


def _inputs(rng, args, world, tokens, hidden, dtype, split, replicated):
    x = rng.standard_normal((world, tokens, hidden), dtype=np.float32) / np.float32(
        math.sqrt(world)
    )
    if args.method == "loop":
        # The loop adds the same partial sums to the residual every call: scaled by 1/iters,
        # the residual stays O(1) however many calls run (no fp16 overflow).
        x /= np.float32(args.iters)
    residual = rng.standard_normal((tokens, hidden), dtype=np.float32)
    gamma = 1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)
    # Static FP8 dequantization scale: norm outputs are O(1), so |y| / scale stays well
    # inside e4m3's range (448).
    scale = np.asarray([1.0 / 32.0], np.float32)
    return (
        jax.device_put(x.astype(dtype), split),
        jax.device_put(residual.astype(dtype), replicated),
        jax.device_put(gamma.astype(dtype), replicated),
        jax.device_put(scale, replicated),
    )


def main(args) -> int:
    mesh = tp_mesh()
    world = mesh.shape[AXIS]
    check_supported(world, args.hidden, args.dtype)
    unknown = [p for p in args.patterns if p not in PATTERN_LABELS]
    if unknown:
        raise SetupError(
            f"--patterns: the bench times patterns {sorted(PATTERN_LABELS)}, not {unknown}"
        )
    group = int(Pattern.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant)
    for hidden in args.hidden:
        if group in args.patterns and hidden % GROUP_SIZE:
            raise SetupError(
                f"pattern {group} quantizes groups of {GROUP_SIZE}: --hidden "
                f"{hidden} is not a multiple of {GROUP_SIZE}"
            )
    if args.method == "loop" and args.patterns != [int(Pattern.kARResidualRMSNorm)]:
        raise SetupError(
            "--method loop times pattern 1 only (its loop drops the quantized "
            "outputs, which XLA would then not compute for the baseline)"
        )
    dtype = jnp.dtype(args.dtype)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    method = args.method
    if method == "auto":
        method = "device" if timing.available() else "chain"
    elif method == "device" and not timing.available():
        raise SetupError(
            "--method device needs GPUs and the native module (device clock "
            "stamps); use --method chain"
        )
    calls = args.iters if method == "loop" else args.chain

    with open_workspace(
        mesh,
        max_token_num=max(args.tokens),
        hidden_dim=max(args.hidden),
        dtype=dtype,
        backend=args.backend,
    ) as ws:
        machine = _machine_info(world, ws.backend)
        banner = reference_banner(machine["device_kind"]) if ws.backend == "xla" else None
        print(describe_devices(world, ws.backend))

        def program(combine, n):
            if method == "loop":
                return jax.jit(
                    jax.shard_map(
                        looped(combine, n),
                        mesh=mesh,
                        in_specs=(P(AXIS), P(), P(), P()),
                        out_specs=P(),
                    )
                )
            if method == "chain":
                return jax.jit(
                    jax.shard_map(
                        chained(combine, n),
                        mesh=mesh,
                        in_specs=(P(AXIS), P(), P(), P()),
                        out_specs=P(),
                    )
                )
            return jax.jit(
                jax.shard_map(
                    stamped(chained(combine, n)),
                    mesh=mesh,
                    in_specs=(P(AXIS), P(), P(), P()),
                    out_specs=(P(AXIS), P(AXIS), P(), P(), P()),
                )
            )

        def measure(combine, inputs, prog=None):
            """(median per-call seconds, detail for the JSON); ``prog``: the compiled
            program of ``combine`` when already built."""
            prog = prog if prog is not None else program(combine, calls)
            if method == "device":
                span = device_seconds(prog, inputs, args.repeats)
                return span / calls, {"device_s": {calls: span}}
            times = per_call_seconds(prog, inputs, calls, args.repeats)
            return statistics.median(times), {"us_repeats": [x * 1e6 for x in times]}

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
        per_mode = 1 + (2 * TIMEOUT_ROUNDS - 1 if args.timeout_compare else 0)
        bar = report_files.progress_bar(
            len(args.patterns) * sum(1 + per_mode * len(runnable) for _, _, runnable, _ in plan),
            "loop",
        )
        try:
            for tokens, hidden, runnable, skipped in plan:
                inputs = _inputs(rng, args, world, tokens, hidden, dtype, split, replicated)
                for pattern in args.patterns:
                    bar.set_description(f"p{pattern} {tokens}x{hidden} XLA")
                    base, detail = measure(baseline_combine(pattern), inputs)
                    bar.update()
                    case = {
                        "pattern": pattern,
                        "tokens": tokens,
                        "hidden": hidden,
                        "baseline": PATTERN_LABELS[pattern],
                        "baseline_us": base * 1e6,
                        "baseline_detail": detail,
                        "fused": {},
                        "skipped": skipped,
                    }
                    for mode, chosen in runnable.items():
                        bar.set_description(f"p{pattern} {tokens}x{hidden} fused {mode}")
                        fused = fused_combine(ws, pattern, USE_ONESHOT[mode])
                        prog = program(fused, calls)
                        t, detail = measure(fused, inputs, prog)
                        bar.update()
                        case["fused"][mode] = {
                            "chosen": chosen,
                            "us": t * 1e6,
                            "ratio": t * 1e6 / case["baseline_us"],
                            "detail": detail,
                        }
                        if args.timeout_compare:
                            bar.set_description(f"p{pattern} {tokens}x{hidden} {mode} t=0")
                            # Alternating rounds of the same compiled program, the timeout
                            # switched on the device in between: drift hits both alike.
                            on_s, ons, offs = ws.timeout_s, [t], []
                            for r in range(TIMEOUT_ROUNDS):
                                ws.set_timeout(0)
                                try:
                                    offs.append(measure(fused, inputs, prog)[0])
                                finally:
                                    ws.set_timeout(on_s)
                                if r + 1 < TIMEOUT_ROUNDS:
                                    ons.append(measure(fused, inputs, prog)[0])
                            case["fused"][mode].update(
                                timeout_compare(
                                    statistics.median(ons) * 1e6,
                                    statistics.median(offs) * 1e6,
                                    on_s,
                                )
                            )
                    cases.append(case)
        finally:
            bar.close()

    description = {
        "device": "per-call time = median device time of a program of chain dependent calls "
        "/ chain, between device-clock stamps, slower device",
        "chain": "per-call time = wall time of a program of chain dependent calls / chain, "
        "median over repeats",
        "loop": "per-call time = (lax.fori_loop of iters calls) / iters, median over repeats",
    }[method]
    report = {
        "machine": machine,
        "config": {
            "dtype": args.dtype,
            "method": method,
            "chain": args.chain,
            "iters": args.iters,
            "repeats": args.repeats,
            "patterns": args.patterns,
            "tokens": args.tokens,
            "hidden": args.hidden,
            "modes": args.modes,
            "max_token_num": max(args.tokens),
            "hidden_dim": max(args.hidden),
            "rms_eps": RMS_EPS,
            "group_size": GROUP_SIZE,
            "timeout_compare": bool(args.timeout_compare),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "reference_path": machine["backend"] == "xla",
        "method": description,
        "cases": cases,
    }
    print()
    if banner:
        print(banner)
    _print_table(report)
    _print_timeout_table(report)
    report_files.write_results(out_dir, "bench", report, plot)
    return 0
