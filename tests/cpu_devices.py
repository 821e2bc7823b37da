"""The JAX devices of the CPU tests: 8 virtual CPU devices. JAX reads JAX_PLATFORMS when it
is imported and XLA_FLAGS when it first starts its backend, so the conftest.py of every folder
of CPU tests that use JAX calls use_host_devices() before pytest imports its test modules; a
value already in the environment wins. Imports no JAX."""

import os

HOST_DEVICES = 8
HOST_DEVICES_FLAG = f"--xla_force_host_platform_device_count={HOST_DEVICES}"
# XLA compiles the CPU tests' programs without LLVM's optimizations: on 2 cores
# test_autodiff.py and test_fuse_styles.py took 68 s instead of 96 s, the whole suite 597 s
# instead of 670 s. Without fast-math (XLA's default) LLVM's optimizations keep IEEE
# results, so what the tests compare is the same.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
# XLA may otherwise keep a bfloat16 / float16 intermediate in float32 where the program
# rounds it (excess precision), depending on how it fuses the program. The tests compare
# roundings bit for bit, so every rounding the program writes is kept.
EXACT_ROUNDING_FLAG = "--xla_allow_excess_precision=false"


def xla_flags(devices: int = HOST_DEVICES) -> str:
    """XLA_FLAGS for a CPU test process with `devices` host devices."""
    return (
        f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAG} "
        f"{EXACT_ROUNDING_FLAG}"
    )


def use_host_devices() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", xla_flags())


def run_module(module: str, *argv, xla_flags=None, pythonpath=(), timeout=600):
    """``python -m module argv...`` from the repository root on CPU, as a user runs it, with
    ``xla_flags`` as XLA_FLAGS (None: unset, for the command to decide) and ``pythonpath``
    first on PYTHONPATH; the completed process (text output captured)."""
    import subprocess
    import sys

    from tests.repo import REPO

    path = os.pathsep.join([*map(str, pythonpath), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    env.pop("XLA_FLAGS", None)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    cmd = [sys.executable, "-m", module, *map(str, argv)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
