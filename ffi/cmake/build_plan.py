#!/usr/bin/env python3
"""Whether a build compiles the CUDA kernels (libfusedar_core), for which architectures, and
why: the one rule that ``pip install`` (ffi/CMakeLists.txt runs this at configure time) and
``./dev`` (``./dev build-plan``, ``./dev setup``) both follow.

  JAX_FUSEDAR_BUILD_KERNELS=1|true|yes|on    build them, for JAX_FUSEDAR_CUDA_ARCHS
                                             (default DEFAULT_ARCHS: H100/H200 and B200)
  JAX_FUSEDAR_BUILD_KERNELS=0|false|no|off   never build them
  unset (the default)                        build them where a GPU is visible (nvidia-smi),
                                             for its architectures (JAX_FUSEDAR_CUDA_ARCHS
                                             overrides), where JAX_FUSEDAR_REQUIRE_CUDA=1
                                             asks for them, or where this build tree built
                                             them before (``--previous``: kept in step with
                                             the sources, for its architectures); else skip
                                             them: the package runs its reference path (a
                                             machine without a GPU cannot run the kernels)

Prints five lines: 1 or 0 (build them); the architectures, comma-separated (empty: the
build tree's own); why; 1 when the kernels were asked for (a missing CUDA compiler is then
an error, not a reference-only build); the announcement to print before the build (what,
for which architectures, about how long, how to skip), empty when not building. Exit 2 with
the reason on stderr for a value it cannot read. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys

DEFAULT_ARCHS = ("90a", "100a")
# CPU time of the kernels per architecture: the 60 translation units and the register
# probe. Measured on 2026-12-03 at commit 8d446bb on a 2-core x86-64 machine (nvcc 13.0):
# 19.9 CPU-minutes for sm_90a + sm_100a.
CPU_MINUTES_PER_ARCH = 10.0
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _flag(name: str, raw) -> "bool | None":
    word = (raw or "").strip().lower()
    if word == "":
        return None
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name} must be 1/true/yes/on or 0/false/no/off, got '{raw}'")


def visible_gpu_archs() -> list:
    """The CUDA architectures of the visible GPUs ("90a" for compute capability 9.0; the 'a'
    variants from sm_90 on enable the clusters/PDL code), none without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    archs = []
    for line in out.splitlines():
        major, _, minor = line.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            arch = f"{int(major)}{int(minor)}{'a' if int(major) >= 9 else ''}"
            if arch not in archs:
                archs.append(arch)
    return archs


def plan(env, *, build_kernels=None, archs=None, require_cuda=None, previous=False):
    """(build, archs, why, asked). ``build_kernels``/``archs``/``require_cuda``: values given
    to CMake (-D), which take precedence over the environment's."""
    want = _flag(
        "JAX_FUSEDAR_BUILD_KERNELS",
        env.get("JAX_FUSEDAR_BUILD_KERNELS", "") if build_kernels is None else build_kernels,
    )
    required = _flag(
        "JAX_FUSEDAR_REQUIRE_CUDA",
        env.get("JAX_FUSEDAR_REQUIRE_CUDA", "") if require_cuda is None else require_cuda,
    )
    told = [
        a
        for a in (env.get("JAX_FUSEDAR_CUDA_ARCHS", "") if archs is None else archs)
        .replace(",", ";")
        .split(";")
        if a.strip()
    ]
    if want is False:
        if required:
            raise ValueError(
                "JAX_FUSEDAR_REQUIRE_CUDA=1 asks for the kernels and "
                "JAX_FUSEDAR_BUILD_KERNELS=0 forbids them"
            )
        return False, [], "JAX_FUSEDAR_BUILD_KERNELS=0", False
    if want:
        return True, told or list(DEFAULT_ARCHS), "JAX_FUSEDAR_BUILD_KERNELS=1", True
    if required:
        return True, told or list(DEFAULT_ARCHS), "JAX_FUSEDAR_REQUIRE_CUDA=1", True
    gpus = visible_gpu_archs()
    if gpus:
        return True, told or gpus, f"GPU visible ({', '.join(gpus)})", False
    if previous:
        return True, told, "built in this build tree before", False
    return False, [], "no GPU visible", False


def announcement(archs, why, cores=None) -> str:
    """What the build says before it compiles the kernels."""
    cores = cores or len(os.sched_getaffinity(0))
    skip = (
        "JAX_FUSEDAR_BUILD_KERNELS=0 skips them (the package then runs its reference path), "
        "JAX_FUSEDAR_CUDA_ARCHS=90a builds one architecture"
    )
    if not archs:
        return (
            f"jax_fusedar: compiling the CUDA kernels ({why}) for the build tree's "
            f"architectures: only what changed, up to {CPU_MINUTES_PER_ARCH:.0f} CPU-minutes "
            f"per architecture. {skip}"
        )
    minutes = math.ceil(CPU_MINUTES_PER_ARCH * len(archs) / cores)
    return (
        f"jax_fusedar: compiling the CUDA kernels ({why}) for "
        f"{', '.join('sm_' + a for a in archs)}: about {minutes} min with {cores} core"
        f"{'s' if cores != 1 else ''} ({CPU_MINUTES_PER_ARCH:.0f} CPU-minutes per "
        f"architecture). {skip}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-kernels", default=None, help="CMake's JAX_FUSEDAR_BUILD_KERNELS")
    p.add_argument("--archs", default=None, help="CMake's JAX_FUSEDAR_CUDA_ARCHS")
    p.add_argument("--require-cuda", default=None, help="CMake's JAX_FUSEDAR_REQUIRE_CUDA")
    p.add_argument(
        "--previous", action="store_true", help="this build tree built the kernels before"
    )
    opts = p.parse_args(argv)
    try:
        build, archs, why, asked = plan(
            os.environ,
            build_kernels=opts.build_kernels,
            archs=opts.archs,
            require_cuda=opts.require_cuda,
            previous=opts.previous,
        )
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(int(build))
    print(",".join(archs))
    print(why)
    print(int(asked))
    print(announcement(archs, why) if build else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
