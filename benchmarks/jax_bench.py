"""``python -m benchmarks.jax_bench``: latency of jax_fusedar's fused op against the unfused
XLA ops a model would write, both in the same process and run. A client of the public API
(``jax_fusedar.allreduce_fusion`` / ``create_allreduce_fusion_workspace``, ``jax_fusedar.timing``,
``jax_fusedar.common.plan``); run it from the repository root.

Three timing methods:

* ``device`` (the default on GPUs): one jitted program of K = ``--chain`` dependent calls
  (as in ``chain`` below) bracketed by device-clock stamps (``jax_fusedar.timing``) on every
  GPU, ordered by data dependencies, so the figure is what the GPUs spent, not how fast the
  host dispatched: the program's device time / K, for the slower device, one sample per
  ``--repeats``. Gaps the host leaves between kernels count, as in a model, and so does the
  first call's wait for the other GPU to start (spread over K calls, so the figure errs on
  the slow side). A difference of two program lengths would remove that wait but, measured
  on 2 x H200, the start skew varies by tens of microseconds between runs, which made the
  difference noisier than the wait it removes.
* ``chain`` (the default elsewhere): the same program of K dependent calls, each call's
  input being the previous call's norm output (a real dependency, as between the layers of a
  model, so XLA can neither reorder nor combine the baseline's all-reduces), timed by the
  host clock around the whole program: wall time / K, one sample per ``--repeats``. Includes
  the host's dispatch of the program, spread over K calls.
* ``loop``: a ``lax.fori_loop`` of ``--iters`` calls on the same input (the method of the
  yardsticks in docs/benchmarks.md). XLA's while loop syncs with the host every iteration,
  which adds the same few microseconds to both columns.

Every figure is reported as the median, p10 and p90 of its samples, with their count.

``--timeout-compare`` times every fused case with the workspace's wait timeout (``timeout_s``,
always on by default) and with it off (``set_timeout(0)``, FlashInfer's spin-forever waits),
TIMEOUT_ROUNDS alternating rounds each on the same workspace and compiled program, and
prints the medians and their ratio.

Patterns: 1 (all-reduce + residual + RMSNorm) against ``psum`` + add + RMSNorm in plain jnp;
the FP8 patterns 4 (static), 11 (dynamic per token) and 9 (per-token group, 128) against the
same plus the matching FP8 quantization written in jnp (``quantize``: the bytes the fused op
writes, which XLA fuses into the norm's kernel).

Without GPUs it runs on 8 virtual CPU devices (unless ``XLA_FLAGS`` or
``jax_num_cpu_devices`` say otherwise) through the XLA reference path, not the kernel.
"""

from __future__ import annotations

import argparse
import math
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

from benchmarks import report
from benchmarks.report import DTYPES, USE_ONESHOT, int_list, mode_list, positive_int

PROG = "python -m benchmarks.jax_bench"
AXIS = "tp"
RMS_EPS = 1e-6
GROUP_SIZE = 128
HOST_DEVICES = 8  # without GPUs: the fused op needs 2, 4, 8 or 16 ranks
FP8_MAX = 448.0
# Patterns the bench knows how to time, with the label of their unfused XLA twin.
PATTERN_LABELS = {
    1: "psum + add + RMSNorm",
    4: "... + static FP8",
    11: "... + dynamic FP8",
    9: f"... + group FP8 ({GROUP_SIZE})",
}
OUT_FILES = ("bench.json", "bench.png")


class SetupError(ValueError):
    """A configuration this machine cannot run; printed without a traceback (exit 2)."""


# --- arguments -------------------------------------------------------------------------------


def _pattern_list(text: str) -> list:
    """--patterns: codes of the patterns the bench times (a valid pattern it does not time is
    named as such)."""
    from jax_fusedar import AllReduceFusionPattern  # no JAX: the enum of the rules layer

    codes = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            codes.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an integer") from None
    if not codes:
        raise argparse.ArgumentTypeError("expected a comma-separated list of pattern codes")
    untimed = sorted({c for c in codes if c not in PATTERN_LABELS})
    if untimed:
        known = {int(p): p.name for p in AllReduceFusionPattern}
        what = "; ".join(
            f"{c} ({known[c]}) is a fusion pattern the bench does not time"
            if c in known
            else f"{c} is not a fusion pattern"
            for c in untimed
        )
        raise argparse.ArgumentTypeError(
            f"the bench times patterns {', '.join(map(str, sorted(PATTERN_LABELS)))}: {what}"
        )
    return sorted(set(codes))


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Time jax_fusedar's fused op against its unfused XLA twin (psum + residual "
        "add + RMSNorm, + the FP8 quantization for patterns 4, 11, 9) for every tokens x "
        "hidden size, both in the same run; median, p10 and p90 of --repeats samples. "
        "--method device / chain: one jitted program of --chain dependent calls (each fed "
        "the previous norm output), time / chain; --method loop: a lax.fori_loop of --iters "
        "calls, time / iters. Writes bench.json and bench.png to --out.",
    )
    p.add_argument(
        "--tokens", type=int_list, default="1,16,128,1024,4096", help="comma-separated token counts"
    )
    p.add_argument(
        "--hidden", type=int_list, default="4096,8192", help="comma-separated hidden sizes"
    )
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument(
        "--patterns",
        type=_pattern_list,
        default="1,4,11,9",
        help="fusion patterns to time: 1 (AR + residual + RMSNorm), 4 (+ static FP8), "
        "11 (+ dynamic per-token FP8), 9 (+ per-token-group FP8)",
    )
    p.add_argument(
        "--method",
        choices=("auto", "device", "chain", "loop"),
        default="auto",
        help="device: dependent calls unrolled in one program, timed by device-clock stamps "
        "(GPUs); chain: the same timed by the host clock; loop: fori_loop (pattern 1 only); "
        "auto: device on GPUs, else chain",
    )
    p.add_argument(
        "--chain",
        type=positive_int,
        default=32,
        help="dependent calls per timed program (--method device, chain)",
    )
    p.add_argument(
        "--iters", type=positive_int, default=200, help="calls per timed loop (--method loop)"
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=10,
        help="timed programs per case: the samples of its median, p10 and p90",
    )
    p.add_argument(
        "--modes",
        type=mode_list,
        default="auto",
        help="fused op modes: auto (use_oneshot=None), oneshot, twoshot",
    )
    p.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png")
    p.add_argument(
        "--backend",
        choices=("auto", "trtllm", "xla"),
        default="auto",
        help="fused op backend: auto = the kernel on GPUs, XLA elsewhere",
    )
    p.add_argument(
        "--timeout-compare",
        action="store_true",
        help="also time every fused case with the kernel's wait timeout off (timeout_s=0) "
        "on the same workspace, and print the on/off cost",
    )
    return p


def parse_args(argv=None, prog: str = PROG):
    """The arguments, checked before JAX starts: the options, the hidden sizes against the
    kernel's 16-byte vectors and the group size, and --out."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    vec = 16 // (4 if args.dtype == "float32" else 2)
    for hidden in args.hidden:
        if hidden % vec:
            parser.error(
                f"--hidden {hidden} is not a multiple of {vec}: the kernel moves 16-byte "
                f"vectors ({vec} x {args.dtype})"
            )
        if 9 in args.patterns and hidden % GROUP_SIZE:
            parser.error(
                f"pattern 9 quantizes groups of {GROUP_SIZE}: --hidden {hidden} is not a "
                f"multiple of {GROUP_SIZE}"
            )
    if args.method == "loop" and args.patterns != [1]:
        parser.error(
            "--method loop times pattern 1 only (its loop drops the quantized outputs, "
            "which XLA would then not compute for the baseline)"
        )
    problem = report.check_out_dir(args.out, OUT_FILES)
    if problem:  # before anything is measured
        parser.error(f"--out {args.out}: {problem}")
    return args


# --- what each case runs ---------------------------------------------------------------------


def plan_mode(tokens: int, hidden: int, sizes, dtype: str, mode: str):
    """(algorithm, None) the fused op runs for this case and --modes entry ("oneshot",
    "twoshot" or "large", as ``jax_fusedar.common.plan`` decides it for the op), or (None,
    why) when that mode cannot run it. What the kernel would run: on an "xla" workspace too."""
    from jax_fusedar.common import plan as rules

    call = rules.Call(rules.DENSE_RULE, tokens, hidden, dtype, sizes, use_oneshot=USE_ONESHOT[mode])
    try:
        decided = rules.plan_call(call)
    except ValueError as e:
        return None, str(e)
    if decided.algorithm is None:
        return None, decided.reason
    return decided.algorithm, None


def large_message_crossover(hidden: int, sizes, dtype: str):
    """Fewest tokens from which "auto" runs the large-message algorithm at this hidden size,
    within the workspace (for the plot), or None where it never does: the plan's own answer,
    found by bisection (it picks the path from a size threshold)."""
    top = sizes.max_token_num * sizes.hidden_dim // hidden
    if top < 1 or plan_mode(top, hidden, sizes, dtype, "auto")[0] != "large":
        return None
    lo, hi = 1, top  # plan(hi) is large
    while lo < hi:
        mid = (lo + hi) // 2
        if plan_mode(mid, hidden, sizes, dtype, "auto")[0] == "large":
            hi = mid
        else:
            lo = mid + 1
    return lo


def quantize(norm, pattern: int, scale):
    """The FP8 quantization of pattern 4, 11 or 9 written in jnp as a model would (what the
    fused op writes, the same bytes: tests/benchmarks/test_jax_bench.py compares them with the
    op's reference): the tuple of quantized outputs, empty for pattern 1."""
    import jax
    import jax.numpy as jnp

    y = norm.astype(jnp.float32)
    if pattern == 4:  # static: the dequantization scale, applied through its reciprocal
        q = jnp.clip(y * (jnp.float32(1.0) / scale[0]), -FP8_MAX, FP8_MAX)
        return (q.astype(jnp.float8_e4m3fn),)
    if pattern == 11:  # dynamic: one scale per token
        amax = jnp.max(jnp.abs(y), axis=-1, keepdims=True)
        s = jnp.maximum(amax / FP8_MAX, jnp.float32(2.0**-9 / FP8_MAX))
        return (jnp.clip(y / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), s)
    if pattern == 9:  # per group of GROUP_SIZE: power-of-two scales, packed UE8M0 bytes
        m, h = y.shape
        groups = y.reshape(m, h // GROUP_SIZE, GROUP_SIZE)
        amax = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
        s = jnp.maximum(amax / FP8_MAX, jnp.float32(1e-10))
        bits = jax.lax.bitcast_convert_type(s, jnp.uint32)  # round up to a power of two
        bits = jnp.where(
            bits & 0x7FFFFF, (bits + jnp.uint32(0x800000)) & jnp.uint32(0x7F800000), bits
        )
        s = jax.lax.bitcast_convert_type(bits, jnp.float32)
        q = jnp.clip(groups / s, -FP8_MAX, FP8_MAX).reshape(m, h).astype(jnp.float8_e4m3fn)
        # DeepGEMM's scale tensor: 4 exponents per int32, MN-major, rows padded to 4.
        exps = (bits[..., 0] >> 23) & 0xFF  # [m, h / GROUP_SIZE]
        k, t = -(-exps.shape[1] // 4), -(-m // 4) * 4
        e = jnp.pad(exps, ((0, t - m), (0, 4 * k - exps.shape[1]))).reshape(t, k, 4)
        words = e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)
        return (q, jax.lax.bitcast_convert_type(words.T, jnp.int32))
    return ()


def plain_add_rmsnorm(partial, residual, gamma):
    """The unfused combine as a model writes it: psum in the model dtype (what NCCL does),
    residual add, RMSNorm in float32. Returns (residual_out, norm_out)."""
    import jax
    import jax.numpy as jnp

    residual = jax.lax.psum(partial, AXIS) + residual
    r = residual.astype(jnp.float32)
    norm = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + RMS_EPS)
    return residual, (norm * gamma.astype(jnp.float32)).astype(residual.dtype)


def fused_combine(ws, pattern: int, use_oneshot):
    """combine(x, residual, gamma, scale) -> (residual_out, norm_out, quantized outputs)."""
    import jax_fusedar as jf

    quant = {}
    if pattern == 4:
        quant = {"scale_factor": None}
    elif pattern == 9:
        quant = {"block_quant_group_size": GROUP_SIZE}

    def combine(x, residual, gamma, scale):
        kw = dict(quant)
        if "scale_factor" in kw:
            kw["scale_factor"] = scale
        out = jf.allreduce_fusion(
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
        return residual, norm, quantize(norm, pattern, scale)

    return combine


def chained(combine, calls: int):
    """Per-rank body: ``calls`` calls, each fed the previous call's norm output as its partial
    sum. Every call's quantized outputs are returned, so none is dead code."""
    import jax

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
    import jax
    import jax.numpy as jnp

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


def stamped(body):
    """Wraps a per-rank body so that it returns (start stamp, end stamp, body's outputs...):
    the start stamp passes x through to the first call, the end stamp follows the norm of
    the last call (which follows its residual)."""
    from jax_fusedar import timing

    def wrapped(x, residual, gamma, scale):
        t0, x = timing.device_timestamp(x)
        residual, norm, extras = body(x, residual, gamma, scale)
        t1, norm = timing.device_timestamp(norm)
        return t0[None], t1[None], residual, norm, extras

    return wrapped


def wall_seconds(fn, args, runs: int) -> list:
    """Seconds of each of ``runs`` calls, each waited for; after a warm-up call, which also
    compiles, so that neither is timed."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def device_seconds(program, inputs, repeats: int) -> list:
    """The device time between a program's two stamps, for the slower device, in each of
    ``repeats`` runs (after a warm-up)."""
    import jax
    import numpy as np

    from jax_fusedar import timing

    jax.block_until_ready(program(*inputs))
    spans = []
    for _ in range(repeats):
        t0, t1 = program(*inputs)[:2]
        spans.append(float(np.max(timing.stamps_to_ns(t1) - timing.stamps_to_ns(t0))) * 1e-9)
    return spans


# --- the report ------------------------------------------------------------------------------


def reference_banner(device_kind: str) -> str:
    return (
        "NOTE: backend 'xla': these numbers time XLA's reference path (psum + residual add "
        f"+ RMSNorm) on {device_kind}, NOT the FlashInfer kernel; 'fused' and the mode "
        "column only say what the kernel would run."
    )


def format_table(rep: dict) -> str:
    """One row per case and mode: the fused op's and the XLA twin's microseconds per call as
    median [p10, p90], their sample count, the ratio of the medians; then the skips."""
    lines = [
        f"{'pattern':>7} {'tokens':>7} {'hidden':>7}  {'mode':<16} {'fused us [p10, p90]':>25} "
        f"{'XLA us [p10, p90]':>25} {'n':>4} {'fused/XLA':>10}"
    ]
    notes = []
    for case in rep["cases"]:
        for mode in rep["config"]["modes"]:
            if mode in case["skipped"]:
                notes.append(
                    f"pattern {case['pattern']} {case['tokens']} x {case['hidden']} "
                    f"{mode}: {case['skipped'][mode]}"
                )
                continue
            m = case["fused"][mode]
            label = f"auto ({m['chosen']})" if mode == "auto" else mode
            n = m["us"]["n"] if m["us"]["n"] == case["baseline_us"]["n"] else "-"
            lines.append(
                f"{case['pattern']:>7} {case['tokens']:>7} {case['hidden']:>7}  {label:<16} "
                f"{report.spread(m['us']):>25} {report.spread(case['baseline_us']):>25} "
                f"{n:>4} {m['ratio']:>10.3f}"
            )
    lines += [f"skipped {note}" for note in notes]
    lines.append(
        "XLA twins: "
        + "; ".join(f"pattern {p}: {PATTERN_LABELS[p]}" for p in rep["config"]["patterns"])
    )
    return "\n".join(lines) + "\n"


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


def format_timeout_table(rep: dict) -> str:
    rows = [
        (case, mode, case["fused"][mode])
        for case in rep["cases"]
        for mode in rep["config"]["modes"]
        if "no_timeout_us" in case["fused"].get(mode, {})
    ]
    if not rows:
        return ""
    lines = [
        f"\nwait timeout on vs off (budget: {TIMEOUT_BUDGET_REL:.0%} or {TIMEOUT_BUDGET_US} us, "
        "whichever is larger; medians of the rounds' medians)",
        f"{'pattern':>7} {'tokens':>7} {'hidden':>7}  {'mode':<16} {'on us':>9} {'off us':>9} "
        f"{'on/off':>8} {'ok':>4}",
    ]
    for case, mode, m in rows:
        label = f"auto ({m['chosen']})" if mode == "auto" else mode
        lines.append(
            f"{case['pattern']:>7} {case['tokens']:>7} {case['hidden']:>7}  {label:<16} "
            f"{m['timeout_on_us']:>9.2f} {m['no_timeout_us']:>9.2f} {m['timeout_ratio']:>8.4f} "
            f"{'yes' if m['timeout_within_budget'] else 'NO':>4}"
        )
    return "\n".join(lines) + "\n"


def plot(rep: dict, path: Path) -> bool:
    """Latency vs tokens, one log-log panel per pattern; one colour per hidden size, the
    fused op solid (a marker per mode) and its XLA twin dashed in the same colour; a dotted
    line in that colour marks where auto switches to the large-message path. False without
    matplotlib."""
    plt = report.pyplot()
    if plt is None:
        return False
    cfg = rep["config"]
    patterns, hiddens = cfg["patterns"], cfg["hidden"]
    colours = report.size_colours(plt, hiddens)
    markers = {"auto": "o", "oneshot": "^", "twoshot": "s"}
    fig, axes = plt.subplots(
        1, len(patterns), figsize=(max(6, 6 * len(patterns)), 5), squeeze=False
    )
    for ax, pattern in zip(axes[0], patterns):
        for hidden in hiddens:
            colour = colours[hidden]
            cases = [c for c in rep["cases"] if c["hidden"] == hidden and c["pattern"] == pattern]
            ax.plot(
                [c["tokens"] for c in cases],
                [c["baseline_us"]["median"] for c in cases],
                report.BASELINE_STYLE,
                color=colour,
                marker="x",
                label=f"XLA, hidden {hidden}",
            )
            for mode in cfg["modes"]:
                points = [
                    (c["tokens"], c["fused"][mode]["us"]["median"])
                    for c in cases
                    if mode in c["fused"]
                ]
                if points:
                    ax.plot(
                        *zip(*points),
                        report.FUSED_STYLE,
                        color=colour,
                        marker=markers[mode],
                        label=f"fused ({mode}), hidden {hidden}",
                    )
            crossover = rep["large_message_from"].get(str(hidden))
            if crossover is not None and "auto" in cfg["modes"]:
                ax.axvline(
                    crossover,
                    linestyle=":",
                    color=colour,
                    label=f"auto: large-message from {crossover} tokens (hidden {hidden})",
                )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="tokens",
            ylabel="us per call (median)",
            title=f"pattern {pattern}: fused vs {PATTERN_LABELS[pattern]}",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="x-small")
    machine = rep["machine"]
    title = (
        f"{machine['device_count']} x {machine['device_kind']}, {cfg['dtype']}, "
        f"backend {machine['backend']}, method {cfg['method']}"
    )
    if machine["backend"] == "xla":
        title += "\nXLA reference path, not the kernel"
    fig.suptitle(title, fontsize="medium")
    report.save_figure(plt, fig, path)
    return True


# --- the run ---------------------------------------------------------------------------------


def _inputs(rng, args, world, tokens, hidden, split, replicated):
    import jax
    import jax.numpy as jnp
    import numpy as np

    dtype = jnp.dtype(args.dtype)
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


def _start_jax():
    """JAX, with 8 virtual CPU devices where it has no GPU (unless the user's XLA_FLAGS or
    jax_num_cpu_devices set a count): set before its backends start."""
    import os

    import jax

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        try:
            if jax.config.jax_num_cpu_devices == -1:  # unset
                jax.config.update("jax_num_cpu_devices", HOST_DEVICES)
        except (AttributeError, RuntimeError):  # backends already started: keep what is there
            pass
    return jax


def machine_info(jax, world: int, backend: str) -> dict:
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


def main(argv=None, prog: str = PROG) -> int:
    args = parse_args(argv, prog)
    try:
        return run(args)
    except SetupError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    jax = _start_jax()
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_fusedar as jf
    from jax_fusedar import timing
    from jax_fusedar.common import plan as rules, sizing

    devices = jax.devices()
    world = len(devices)
    if devices[0].platform == "gpu" and world == 1:
        raise SetupError(
            "the bench needs one GPU per rank and this machine has 1 GPU: ranks sharing a "
            "GPU take turns on it, so a timing measures that scheduling, not the kernel. "
            "Run it where each of the 2, 4 or 8 ranks has its own GPU; 'python -m "
            "jax_fusedar demo' checks the kernel's results on one GPU"
        )
    try:
        sizes = sizing.workspace_sizes(world, max(args.tokens), max(args.hidden), args.dtype)
    except ValueError as e:
        raise SetupError(
            f"{e} (this machine has {world} device(s) of kind {devices[0].device_kind!r})"
        ) from None
    for hidden in args.hidden:
        problem = rules.kernel_problem(rules.Call(rules.DENSE_RULE, 1, hidden, args.dtype, sizes))
        if problem is not None:
            raise SetupError(problem[1])
    method = args.method
    if method == "auto":
        method = "device" if timing.available() else "chain"
    elif method == "device" and not timing.available():
        raise SetupError(
            "--method device needs GPUs and the native module (device clock stamps); use "
            "--method chain"
        )
    calls = args.iters if method == "loop" else args.chain
    mesh = jax.make_mesh((world,), (AXIS,), devices=devices)
    rng = np.random.default_rng(0)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    try:
        ws = jf.create_allreduce_fusion_workspace(
            mesh,
            AXIS,
            max_token_num=max(args.tokens),
            hidden_dim=max(args.hidden),
            dtype=jnp.dtype(args.dtype),
            backend=args.backend,
        )
    except ValueError as e:
        raise SetupError(str(e)) from None

    def program(combine, n):
        specs = dict(mesh=mesh, in_specs=(P(AXIS), P(), P(), P()))
        if method == "loop":
            return jax.jit(jax.shard_map(looped(combine, n), out_specs=P(), **specs))
        if method == "chain":
            return jax.jit(jax.shard_map(chained(combine, n), out_specs=P(), **specs))
        return jax.jit(
            jax.shard_map(
                stamped(chained(combine, n)), out_specs=(P(AXIS), P(AXIS), P(), P(), P()), **specs
            )
        )

    def measure(combine, inputs, prog=None):
        """(per-call microseconds of each sample, detail for the JSON); ``prog``: the
        compiled program of ``combine`` when already built."""
        prog = prog if prog is not None else program(combine, calls)
        if method == "device":
            spans = device_seconds(prog, inputs, args.repeats)
            return [s / calls * 1e6 for s in spans], {"device_s": spans, "calls": calls}
        times = wall_seconds(prog, inputs, args.repeats)
        return [t / calls * 1e6 for t in times], {"wall_s": times, "calls": calls}

    with ws:
        machine = machine_info(jax, world, ws.backend)
        path = "FlashInfer kernel" if ws.backend == "trtllm" else "XLA reference path"
        print(
            f"devices: {world} x {devices[0].device_kind} (platform {devices[0].platform}), "
            f"world size {world}, backend {ws.backend}: {path}"
        )
        plan = []  # (tokens, hidden, {mode: algorithm}, {mode: reason})
        for tokens in args.tokens:
            for hidden in args.hidden:
                runnable, skipped = {}, {}
                for mode in args.modes:
                    chosen, reason = plan_mode(tokens, hidden, sizes, args.dtype, mode)
                    if reason:
                        skipped[mode] = reason
                    else:
                        runnable[mode] = chosen
                plan.append((tokens, hidden, runnable, skipped))
        cases = []
        per_mode = 1 + (2 * TIMEOUT_ROUNDS - 1 if args.timeout_compare else 0)
        bar = report.progress_bar(
            len(args.patterns) * sum(1 + per_mode * len(r) for _, _, r, _ in plan), "program"
        )
        try:
            for tokens, hidden, runnable, skipped in plan:
                inputs = _inputs(rng, args, world, tokens, hidden, split, replicated)
                for pattern in args.patterns:
                    bar.set_description(f"p{pattern} {tokens}x{hidden} XLA")
                    base, detail = measure(baseline_combine(pattern), inputs)
                    bar.update()
                    case = {
                        "pattern": pattern,
                        "tokens": tokens,
                        "hidden": hidden,
                        "baseline": PATTERN_LABELS[pattern],
                        "baseline_us": report.summary(base),
                        "baseline_samples_us": base,
                        "baseline_detail": detail,
                        "fused": {},
                        "skipped": skipped,
                    }
                    for mode, chosen in runnable.items():
                        bar.set_description(f"p{pattern} {tokens}x{hidden} fused {mode}")
                        fused = fused_combine(ws, pattern, USE_ONESHOT[mode])
                        prog = program(fused, calls)
                        samples, detail = measure(fused, inputs, prog)
                        bar.update()
                        us = report.summary(samples)
                        case["fused"][mode] = {
                            "chosen": chosen,
                            "us": us,
                            "samples_us": samples,
                            "ratio": us["median"] / case["baseline_us"]["median"],
                            "detail": detail,
                        }
                        if args.timeout_compare:
                            bar.set_description(f"p{pattern} {tokens}x{hidden} {mode} t=0")
                            # Alternating rounds of the same compiled program, the timeout
                            # switched on the device in between: drift hits both alike.
                            on_s, ons, offs = ws.timeout_s, [us["median"]], []
                            for r in range(TIMEOUT_ROUNDS):
                                ws.set_timeout(0)
                                try:
                                    offs.append(statistics.median(measure(fused, inputs, prog)[0]))
                                finally:
                                    ws.set_timeout(on_s)
                                if r + 1 < TIMEOUT_ROUNDS:
                                    ons.append(statistics.median(measure(fused, inputs, prog)[0]))
                            case["fused"][mode].update(
                                timeout_compare(
                                    statistics.median(ons), statistics.median(offs), on_s
                                )
                            )
                    cases.append(case)
        finally:
            bar.close()

    description = {
        "device": "per-call time = device time of a program of chain dependent calls / chain, "
        "between device-clock stamps, slower device; one sample per repeat",
        "chain": "per-call time = wall time of a program of chain dependent calls / chain; "
        "one sample per repeat",
        "loop": "per-call time = (lax.fori_loop of iters calls) / iters; one sample per repeat",
    }[method]
    rep = {
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
        "method": description + " (reported: median, p10, p90 and count of the samples, us)",
        "large_message_from": {
            str(h): large_message_crossover(h, sizes, args.dtype) for h in args.hidden
        },
        "cases": cases,
    }
    print()
    if rep["reference_path"]:
        print(reference_banner(machine["device_kind"]))
    print(format_table(rep), end="")
    print(format_timeout_table(rep), end="")
    report.write_results(Path(args.out), "bench", rep, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
