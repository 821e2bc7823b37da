"""Fresh Python processes of the JAX CPU tests (a script run with ``python -c``), for what
one process cannot show: XLA flags read once, a module that must not load, several hosts."""

import os
import subprocess
import sys

from tests.cpu_devices import xla_flags
from tests.repo import REPO


def cpu_env(devices: int, **extra) -> dict:
    """This environment for a JAX process on ``devices`` CPU devices with the CPU tests' XLA
    flags (tests/cpu_devices.py), this checkout first on PYTHONPATH; plus ``extra``."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices), PYTHONPATH=path, **extra
    )


def run_script(script: str, *args: str, env: dict, timeout: int, stdin=None):
    """``python -c script args...`` in the checkout's root; its CompletedProcess (text)."""
    kw = dict(input=stdin, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return subprocess.run([sys.executable, "-c", script, *args], **kw)
