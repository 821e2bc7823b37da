"""Every ``JAX_FUSEDAR_*`` environment variable the project reads, checked at once with the
parser that reads it later. Framework-neutral (never imports jax or torch).

The library reads each variable where it is needed: ``JAX_FUSEDAR_STRICT`` at the first
traced call, the others when a workspace is created. A command-line run calls ``problems()``
first, so a bad value ends it with one line naming the variable before any work starts
(instead of a traceback from deep inside a run that already set up devices and workspaces).

A misspelled name (``JAX_FUSEDAR_STICT=1``) would be ignored silently, the user believing
strict mode on: ``import jax_fusedar`` (and so ``torch_compat`` and the CLI) warns about
every ``JAX_FUSEDAR_*`` variable set that nothing reads (``unknown()``, ``warn_unknown()``),
naming the nearest known one. ``KNOWN`` lists them all, the build's and the tests' too (a
user of ./dev or the GPU suite sets those), so that none of them is warned about.
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Callable, List, Mapping, Optional, Tuple

from . import backend_choice, handshake


def _backend() -> None:
    backend_choice.requested_backend_name(None)


# (variable, the parser the library reads it with), in the order messages list them.
READERS: Tuple[Tuple[str, Callable[[], object]], ...] = (
    (backend_choice.BACKEND_ENV_VAR, _backend),
    (backend_choice.STRICT_ENV_VAR, lambda: backend_choice.strict_mode(None)),
    (handshake.HANDSHAKE_ENV_VAR, lambda: handshake.resolve_handshake(None)),
    (handshake.HANDSHAKE_TIMEOUT_ENV_VAR, lambda: handshake.resolve_handshake_timeout_s(None)),
    (handshake.TIMEOUT_ENV_VAR, lambda: handshake.resolve_timeout_s(None)),
    # 0.1.0's names of the handshake's variables, read where the new name is unset.
    ("JAX_FUSEDAR_CHECK_CALLS", lambda: handshake.resolve_handshake(None)),
    ("JAX_FUSEDAR_CHECK_TIMEOUT_S", lambda: handshake.resolve_handshake_timeout_s(None)),
)


def problems() -> List[str]:
    """What is wrong with the variables of ``READERS`` as set in ``os.environ`` (each message
    names its variable, its value and what it may be); empty when all are usable."""
    found = []
    for _, read in READERS:
        try:
            read()
        except (TypeError, ValueError) as e:
            if str(e) not in found:  # a variable and its earlier name share a parser
                found.append(str(e))
    return found


PREFIX = "JAX_FUSEDAR_"

# Every other JAX_FUSEDAR_* variable something in the repository reads, by who reads it
# (tests/common/test_environment.py holds this list equal to the names the repository uses).
OTHER_VARIABLES = {
    # the torch benchmark: the folder of FlashInfer's own build to time against
    "JAX_FUSEDAR_ANCHOR": "python -m benchmarks.torch_bench",
    # the build: pip install (CMake, pyproject.toml) and ./dev
    "JAX_FUSEDAR_BUILD_KERNELS": "the build",
    "JAX_FUSEDAR_CUDA_ARCHS": "the build",
    "JAX_FUSEDAR_PREBUILT_CORE": "the build",
    "JAX_FUSEDAR_REQUIRE_CUDA": "the build",
    "JAX_FUSEDAR_CMAKE_ARGS": "./dev",
    "JAX_FUSEDAR_VENV": "./dev",
    "JAX_FUSEDAR_OLDEST_VENV": "./dev",
    "JAX_FUSEDAR_TEST_WORKERS": "./dev",
    "JAX_FUSEDAR_LINT_VENV": "tools/lint.sh",
    "JAX_FUSEDAR_GPU_BUNDLE": "tools/wheel_gpu_check.sh",
    # the test suite
    "JAX_FUSEDAR_BUILD_DIR": "the tests",
    "JAX_FUSEDAR_FRAMEWORK_VENV": "the tests",
    "JAX_FUSEDAR_REPORT_DIR": "the GPU tests",
    "JAX_FUSEDAR_LANE": "the GPU tests",
    "JAX_FUSEDAR_TEST_SEED": "the GPU tests",
    "JAX_FUSEDAR_LOOP_CALLS": "the GPU tests",
    "JAX_FUSEDAR_TIMEOUT_CALLS": "the GPU tests",
    "JAX_FUSEDAR_TORCH_CYCLES": "the GPU tests",
}

# 0.1.0's names of the handshake's variables, still read (common/handshake.py).
OTHER_VARIABLES.update(
    {old: f"the handshake (now ${new})" for old, new in handshake.EARLIER_ENV_VARS.items()}
)

KNOWN = tuple(sorted({var for var, _ in READERS} | set(OTHER_VARIABLES)))


class UnknownVariableWarning(UserWarning):
    """A ``JAX_FUSEDAR_*`` environment variable is set that nothing reads (a typo?)."""


def nearest(name: str) -> Optional[str]:
    """The known variable ``name`` most likely misspells, or None. Compared without the
    shared prefix, which would make every name look close to every other."""
    suffixes = {var[len(PREFIX) :]: var for var in KNOWN}
    close = difflib.get_close_matches(name[len(PREFIX) :], suffixes, n=1, cutoff=0.6)
    return suffixes[close[0]] if close else None


def unknown(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """One message per ``JAX_FUSEDAR_*`` variable set in ``env`` (default os.environ) that
    nothing reads, naming the nearest known variable."""
    env = os.environ if env is None else env
    found = []
    for name in sorted(n for n in env if n.startswith(PREFIX) and n not in KNOWN):
        guess = nearest(name)
        hint = f"did you mean ${guess}?" if guess else f"jax_fusedar reads {', '.join(KNOWN)}"
        found.append(f"${name} is set but jax_fusedar reads no such variable: {hint}")
    return found


def warn_unknown(env: Optional[Mapping[str, str]] = None, *, stacklevel: int = 2) -> None:
    """Warns (UnknownVariableWarning) about each variable ``unknown()`` names."""
    for message in unknown(env):
        warnings.warn(message, UnknownVariableWarning, stacklevel=stacklevel + 1)
