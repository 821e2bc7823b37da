"""Every ``JAX_FUSEDAR_*`` environment variable the package reads, checked at once with the
parser that reads it later. Framework-neutral (never imports jax or torch).

The library reads each variable where it is needed: ``JAX_FUSEDAR_STRICT`` at the first
traced call, the others when a workspace is created. A command-line run calls ``problems()``
first, so a bad value ends it with one line naming the variable before any work starts
(instead of a traceback from deep inside a run that already set up devices and workspaces).
"""

from __future__ import annotations

from typing import Callable, List, Tuple

from . import backend_choice, call_check


def _backend() -> None:
    backend_choice.requested_backend_name(None)


# (variable, the parser the library reads it with), in the order messages list them.
READERS: Tuple[Tuple[str, Callable[[], object]], ...] = (
    (backend_choice.BACKEND_ENV_VAR, _backend),
    (backend_choice.STRICT_ENV_VAR, lambda: backend_choice.strict_mode(None)),
    (call_check.CHECK_CALLS_ENV_VAR, lambda: call_check.resolve_check_calls(None)),
    (call_check.CHECK_TIMEOUT_ENV_VAR, lambda: call_check.resolve_check_timeout_s(None)),
    (call_check.TIMEOUT_ENV_VAR, lambda: call_check.resolve_timeout_s(None)),
)


def problems() -> List[str]:
    """What is wrong with the variables of ``READERS`` as set in ``os.environ`` (each message
    names its variable, its value and what it may be); empty when all are usable."""
    found = []
    for _, read in READERS:
        try:
            read()
        except (TypeError, ValueError) as e:
            found.append(str(e))
    return found
