"""``python -m jax_fusedar {demo,doctor}``: see ``--help``. (``bench`` says where the
benchmarks are: ``benchmarks/`` of the source checkout, not part of the package.)

This module imports no JAX before it has settled the devices: without GPUs it splits the
host into as many virtual CPU devices as the TP group has ranks (the fused op needs 2, 4, 8
or 16; the demo's ``--tp``, default 8), which JAX reads only when it creates its backends.
"""

from __future__ import annotations

import argparse
import sys

from . import argtypes
from .argtypes import DTYPES, check_out_dir
from .ranks import HOST_DEVICE_COUNT_FLAG

BACKENDS = ("auto", "trtllm", "xla")

DESCRIPTION = """\
FlashInfer's fused all-reduce + residual add + RMSNorm for JAX: the demo, and a report
of this machine.

  demo   run a tensor-parallel Llama decoder written in plain JAX (no jax_fusedar call)
         as written and through jax_fusedar.fuse (which replaces its psum + residual add +
         RMSNorm with the fused op); print the sites fused, tokens/s, greedy tokens and the
         logits error; exit 1 if they disagree beyond a stated tolerance.
  doctor print versions, the native build, GPUs and their links, the backend 'auto' would
         pick and the JAX_FUSEDAR_* variables set: one screen for a bug report.

Without GPUs the demo runs on virtual CPU devices through the XLA reference path, not the
kernel: as many as its --tp (default 8), made by the CLI itself, whatever XLA_FLAGS says (a
count set there with %s=N is the default). The benchmarks of the fused op are in the source
checkout: %s.
""" % (HOST_DEVICE_COUNT_FLAG, "python -m benchmarks.jax_bench, python -m benchmarks.torch_bench")

# What `python -m jax_fusedar bench` answers: the benchmarks are the checkout's, not
# the package's.
BENCH_MOVED = (
    "the benchmarks are not part of the package: from a source checkout "
    "(git clone, then the repository root) run python -m benchmarks.jax_bench (the JAX op "
    "against psum + add + RMSNorm) or python -m benchmarks.torch_bench (torch_compat "
    "against FlashInfer, NCCL and symmetric memory); docs/benchmarks.md has the commands"
)


def build_parser():
    """Returns the parser and its subcommand parsers by name."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_fusedar",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,doctor}")
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
    return parser, {"demo": demo, "doctor": doctor}


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
    if argv[:1] == ["bench"]:
        print(f"python -m jax_fusedar bench: {BENCH_MOVED}", file=sys.stderr)
        return 2
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
    # The output folder is checked before anything is measured (a bad --out costs no run).
    out_files = {"demo": ("bench_llama.json",) if args.bench else ()}
    if out_files[args.command]:
        problem = check_out_dir(args.out, out_files[args.command])
        if problem:
            commands[args.command].error(f"--out {args.out}: {problem}")
    # One process per rank where GPUs are fewer than ranks.
    from . import ranks

    code = ranks.dispatch(args, argv, commands[args.command])
    if code is not None:
        return code
    settle_devices(args.plan)
    # Imported here, after the devices are settled, because they import JAX.
    from .setup import SetupError

    if args.moe:
        from .moe_demo import main as run
    else:
        from .demo import main as run
    try:
        return run(args)
    except SetupError as e:
        print(f"{commands[args.command].prog}: error: {e}", file=sys.stderr)
        return 2
