"""``python -m jax_fusedar {demo,bench,doctor}``: see ``--help``.

This module imports no JAX before it has settled the devices: without GPUs it splits the
host into as many virtual CPU devices as the TP group has ranks (the fused op needs 2, 4, 8
or 16; the demo's ``--tp``, default 8), which JAX reads only when it creates its backends.
"""

from __future__ import annotations

import argparse
import sys

from ..common import limits
from . import argtypes
from .argtypes import DTYPES, check_out_dir
from .ranks import HOST_DEVICE_COUNT_FLAG

BACKENDS = ("auto", "trtllm", "xla")
FRAMEWORKS = ("jax", "torch")

DESCRIPTION = (
    """\
FlashInfer's fused all-reduce + residual add + RMSNorm for JAX: demo and benchmark.

  demo   run a tensor-parallel Llama decoder written in plain JAX (no jax_fusedar call)
         as written and through jax_fusedar.fuse (which replaces its psum + residual add +
         RMSNorm with the fused op); print the sites fused, tokens/s, greedy tokens and the
         logits error; exit 1 if they disagree beyond a stated tolerance.
  bench  time the fused op against psum + residual add + RMSNorm for every tokens x hidden
         size (and one-shot/two-shot modes); print a table, write bench.json and bench.png.
  doctor print versions, the native build, GPUs and their links, the backend 'auto' would
         pick and the JAX_FUSEDAR_* variables set: one screen for a bug report.

Without GPUs both run on virtual CPU devices through the XLA reference path, not the
kernel: as many as the demo's --tp (default 8; bench: 8), made by the CLI itself, whatever
XLA_FLAGS says (a count set there with %s=N is the default).
"""
    % HOST_DEVICE_COUNT_FLAG
)


# The patterns `bench` times (bench.PATTERN_LABELS has their unfused twins; a test checks
# the two agree). Known here so that --patterns is checked before JAX starts.
BENCH_PATTERNS = (1, 4, 9, 11)


def _pattern_list(text: str) -> list:
    """--patterns: codes of fusion patterns the bench times. A valid pattern it does not time
    (0, 2, ...) is named as such, not as "not positive" or "unknown"."""
    from ..common.patterns import AllReduceFusionPattern

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
    untimed = sorted({c for c in codes if c not in BENCH_PATTERNS})
    if untimed:
        known = {int(p): p.name for p in AllReduceFusionPattern}
        what = "; ".join(
            f"{c} ({known[c]}) is a fusion pattern the bench does not time"
            if c in known
            else f"{c} is not a fusion pattern"
            for c in untimed
        )
        raise argparse.ArgumentTypeError(
            f"the bench times patterns {', '.join(map(str, BENCH_PATTERNS))}: {what}"
        )
    return sorted(set(codes))


def build_parser():
    """Returns the parser and its subcommand parsers by name."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_fusedar",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,doctor}")
    fmt = argparse.ArgumentDefaultsHelpFormatter

    demo = sub.add_parser(
        "demo",
        formatter_class=fmt,
        help="a Llama decoder written without "
        "jax_fusedar, fused by jax_fusedar.fuse: tokens, errors, speed",
        description="Run a tensor-parallel Llama decoder (plain JAX under "
        "shard_map, random weights) as written and through jax_fusedar.fuse, "
        "layers unrolled and under lax.scan; print the sites fused, prefill "
        "and decode tokens/s, greedy tokens and the logits error. --bench "
        "times decode steps and prefills instead.",
    )
    from .demo_args import add_arguments  # the demo's flags (no JAX: parsed before it starts)

    add_arguments(
        demo,
        positive_int=argtypes.positive_int,
        int_list=argtypes.int_list,
        seed=argtypes.seed,
        dtypes=DTYPES,
        backends=BACKENDS,
    )
    from . import ranks  # the TP size and how its ranks run (imports no JAX)

    ranks.add_arguments(demo)

    bench = sub.add_parser(
        "bench",
        formatter_class=fmt,
        help="latency of the fused op vs psum + residual add + RMSNorm (+ FP8 quantization)",
        description="Time the fused op against its unfused XLA twin (psum "
        "+ residual add + RMSNorm, + the FP8 quantization for patterns 4, "
        "11, 9) for every tokens x hidden size, both in the same run. "
        "--method chain: one jitted program of --chain dependent calls "
        "(each fed the previous norm output), time / chain; --method loop: "
        "a lax.fori_loop of --iters calls, time / iters. Median over "
        "--repeats.",
    )
    bench.add_argument(
        "--tokens",
        type=argtypes.int_list,
        default="1,16,128,1024,4096",
        help="comma-separated token counts",
    )
    bench.add_argument(
        "--hidden", type=argtypes.int_list, default="4096,8192", help="comma-separated hidden sizes"
    )
    bench.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    bench.add_argument(
        "--patterns",
        type=_pattern_list,
        default="1,4,11,9",
        help="fusion patterns to time: 1 (AR + residual + RMSNorm), 4 (+ static "
        "FP8), 11 (+ dynamic per-token FP8), 9 (+ per-token-group FP8)",
    )
    bench.add_argument(
        "--method",
        choices=("auto", "device", "chain", "loop"),
        default="auto",
        help="device: dependent calls unrolled in one program, timed by device-"
        "clock stamps (GPUs); chain: the same timed by the host clock; loop: "
        "fori_loop (pattern 1 only); auto: device on GPUs, else chain",
    )
    bench.add_argument(
        "--chain",
        type=argtypes.positive_int,
        default=32,
        help="dependent calls per timed program (--method device, chain)",
    )
    bench.add_argument(
        "--iters",
        type=argtypes.positive_int,
        default=200,
        help="calls per timed loop (--method loop)",
    )
    bench.add_argument(
        "--repeats",
        type=argtypes.positive_int,
        default=10,
        help="timed programs per case (the median is reported)",
    )
    bench.add_argument(
        "--modes",
        type=argtypes.mode_list,
        default="auto",
        help="fused op modes: auto (use_oneshot=None), oneshot, twoshot",
    )
    bench.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png")
    bench.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="fused op backend: auto = the kernel on GPUs, XLA elsewhere",
    )
    bench.add_argument(
        "--timeout-compare",
        action="store_true",
        help="also time every fused case with the kernel's wait timeout off "
        "(timeout_s=0) on the same workspace, and print the on/off cost",
    )
    bench.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        default="jax",
        help="torch: torch_compat vs FlashInfer's own build, NCCL and symmetric "
        "memory in spawned processes (its own options: bench --framework torch "
        "--help)",
    )
    doctor = sub.add_parser(
        "doctor",
        help="versions, the native build, GPUs and their links, the backend 'auto' would "
        "pick, the JAX_FUSEDAR_* variables: one screen for a bug report",
        description="Print one screen about this machine for a bug report: the versions "
        "of jax, jaxlib, torch, CUDA and the FlashInfer headers, the native build and its "
        "CUDA architectures, the GPUs with their peer access and NVLink / PCIe links, the "
        "backend 'auto' would pick for TP 2, 4 and 8, and the JAX_FUSEDAR_* variables set. "
        "Needs no GPU, no torch, no JAX and no native build.",
    )
    return parser, {"demo": demo, "bench": bench, "doctor": doctor}


def _torch_bench_argv(argv):
    """The arguments for torch_compat.bench when argv asks for ``bench --framework
    torch`` (it has its own options), else None."""
    if not argv or argv[0] != "bench":
        return None
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--framework")
    known, _ = probe.parse_known_args(argv[1:])
    return list(argv[1:]) if known.framework == "torch" else None


def _check_hidden(parser, args) -> None:
    """The kernel moves 16-byte vectors: refuse other hidden sizes before starting JAX."""
    vec = limits.vector_width(args.dtype)
    hiddens = args.hidden if isinstance(args.hidden, list) else [args.hidden]
    for hidden in hiddens:
        if hidden % vec:
            parser.error(
                f"--hidden {hidden} is not a multiple of {vec}: the kernel moves "
                f"16-byte vectors ({vec} x {args.dtype})"
            )


def settle_devices(plan) -> None:
    """Makes this process see exactly the devices of ``plan`` (ranks.single_process_config:
    on CPUs that many virtual devices, with whatever else the user's XLA_FLAGS set). Called
    before any JAX computation: JAX reads these when it creates its backends."""
    from . import ranks

    updates = ranks.single_process_config(plan)
    if updates:
        import jax

        for name, value in updates.items():
            jax.config.update(name, value)


def _environment_problem(argv) -> "str | None":
    """A bad JAX_FUSEDAR_* variable, named with its value (common/environment.py), checked
    before any work so that a run never dies half way through; None also for --help."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    from ..common import environment

    found = environment.problems()
    return "; ".join(found) if found else None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:  # reports bad variables itself, and needs no JAX
        build_parser()[0].parse_args(argv)  # --help, or an unknown flag
        from .doctor import main as doctor

        return doctor(argv[1:])
    problem = _environment_problem(argv)
    if problem:
        print(f"python -m jax_fusedar: error: {problem}", file=sys.stderr)
        return 2
    torch_argv = _torch_bench_argv(argv)
    if torch_argv is not None:  # no JAX in this path
        import importlib.util

        if importlib.util.find_spec("torch") is None:  # torch_compat imports torch
            print(
                "python -m jax_fusedar bench --framework torch: error: torch is not installed",
                file=sys.stderr,
            )
            return 2
        from torch_compat.bench import main as torch_bench

        return torch_bench(torch_argv, prog="python -m jax_fusedar bench --framework torch")
    # Every other command (and its parser: the demo's flags live with the demo) needs JAX,
    # an extra. The check imports nothing: XLA_FLAGS is settled only after parsing.
    import importlib.util

    try:
        has_jax = importlib.util.find_spec("jax") is not None
    except ValueError:  # a blocked module (None in sys.modules)
        has_jax = False
    if not has_jax:
        from .. import NEEDS_JAX

        print(f"python -m jax_fusedar: error: {NEEDS_JAX}", file=sys.stderr)
        return 2
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":  # the demo's hidden size comes from its preset
        _check_hidden(commands[args.command], args)
    # The output folder is checked before anything is measured (a bad --out costs no run).
    out_files = {
        "bench": ("bench.json", "bench.png"),
        "demo": ("bench_llama.json",) if getattr(args, "bench", False) else (),
    }
    if out_files[args.command]:
        problem = check_out_dir(args.out, out_files[args.command])
        if problem:
            commands[args.command].error(f"--out {args.out}: {problem}")
    # One process per rank where GPUs are fewer than ranks; bench refuses shared GPUs.
    from . import ranks

    code = ranks.dispatch(args, argv, commands[args.command])
    if code is not None:
        return code
    settle_devices(args.plan)
    # Imported here, after the devices are settled, because they import JAX.
    from .setup import SetupError

    if args.command == "demo" and args.moe:
        from .moe_demo import main as run
    elif args.command == "demo":
        from .demo import main as run
    else:
        from .bench import main as run
    try:
        return run(args)
    except SetupError as e:
        print(f"{commands[args.command].prog}: error: {e}", file=sys.stderr)
        return 2
