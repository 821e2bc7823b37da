"""``python -m jax_fusedar demo``: see ``--help``. (``bench`` says where the benchmarks are:
``benchmarks/`` of the source checkout, not part of the package.)

This module imports no JAX: without GPUs it first splits the host into 8 virtual CPU devices
(the fused op needs 2, 4, 8 or 16 ranks), which XLA reads only when JAX starts.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..common import native
from . import argtypes
from .argtypes import DTYPES, check_out_dir

BACKENDS = ("auto", "trtllm", "xla")
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"

DESCRIPTION = """\
FlashInfer's fused all-reduce + residual add + RMSNorm for JAX: the demo.

  demo   run a tensor-parallel Llama decoder written in plain JAX (no jax_fusedar call)
         as written and through jax_fusedar.fuse (which replaces its psum + residual add +
         RMSNorm with the fused op); print the sites fused, tokens/s, greedy tokens and the
         logits error; exit 1 if they disagree beyond a stated tolerance.

Without GPUs it runs on 8 virtual CPU devices through the XLA reference path, not the
kernel (XLA_FLAGS=%s is set automatically
when XLA_FLAGS is unset). The benchmarks of the fused op are in the source checkout:
%s.
""" % (HOST_DEVICES_FLAG, "python -m benchmarks.jax_bench, python -m benchmarks.torch_bench")

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
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo}")
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
    from .demo import add_arguments  # the demo owns its flags

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

    return parser, {"demo": demo}


def _ensure_host_devices() -> None:
    # Only when XLA_FLAGS is unset: the user's own flags win. gpu_count() imports no JAX.
    if native.gpu_count() == 0 and "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = HOST_DEVICES_FLAG


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
    problem = _environment_problem(argv)
    if problem:
        print(f"python -m jax_fusedar: error: {problem}", file=sys.stderr)
        return 2
    if argv and argv[0] == "bench":
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
    _ensure_host_devices()
    # Imported here, after XLA_FLAGS is settled, because they import JAX.
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
