"""Options of the opt-in per-call cross-rank handshake (ffi/core/handshake.h): whether a new
workspace's ranks compare every call before the kernel runs and how long a rank waits for
the others (that all members agree is ``join.check_options_agree``'s); and the timeout of
every bounded wait inside the kernel (ffi/core/watchdog.h). Framework-neutral (never
imports jax or torch).

The handshake's names until 0.1.0 were ``check_calls`` / ``check_timeout_s`` and
``$JAX_FUSEDAR_CHECK_CALLS`` / ``$JAX_FUSEDAR_CHECK_TIMEOUT_S``; both fronts still take them
(``EARLIER_NAMES``, ``earlier_name``), and the variables are still read."""

from __future__ import annotations

import os

import numpy as np

from . import arguments

HANDSHAKE_ENV_VAR = "JAX_FUSEDAR_HANDSHAKE"
HANDSHAKE_TIMEOUT_ENV_VAR = "JAX_FUSEDAR_HANDSHAKE_TIMEOUT_S"
# 0.1.0's names: the arguments and the variables, each with the name that replaced it.
EARLIER_NAMES = {"check_calls": "handshake", "check_timeout_s": "handshake_timeout_s"}
EARLIER_ENV_VARS = {
    "JAX_FUSEDAR_CHECK_CALLS": HANDSHAKE_ENV_VAR,
    "JAX_FUSEDAR_CHECK_TIMEOUT_S": HANDSHAKE_TIMEOUT_ENV_VAR,
}


def earlier_name(value, earlier_value, name: str):
    """The argument ``name`` given as itself (``value``) or under its 0.1.0 name
    (``earlier_value``, ``EARLIER_NAMES``); both given is a TypeError."""
    if earlier_value is None:
        return value
    if value is not None:
        old = next(o for o, n in EARLIER_NAMES.items() if n == name)
        raise TypeError(f"pass {name} or its earlier name {old}, not both")
    return earlier_value


def _env_var(var: str) -> str:
    """``var``, or its 0.1.0 name where only that one is set."""
    if os.environ.get(var, "").strip():
        return var
    earlier = next((o for o, n in EARLIER_ENV_VARS.items() if n == var), None)
    return earlier if earlier and os.environ.get(earlier, "").strip() else var


DEFAULT_HANDSHAKE_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 3600.0


def resolve_handshake(value=None) -> bool:
    """Whether a new workspace checks every call across ranks: ``value`` when it is a bool,
    else ``$JAX_FUSEDAR_HANDSHAKE`` (1/true/yes/on or 0/false/no/off; unset: off;
    ``arguments.env_bool``, the parser of every boolean variable).

    With the check on, each launch first runs a one-block handshake kernel in which the ranks
    compare {call number, pattern, dtype, num_tokens, hidden_dim, one-shot, fp32_acc, layout,
    quant group size}; a mismatch, or a rank that does not arrive within the timeout, makes
    the device print what differs and trap (the stream fails with a CUDA error) instead of
    FlashInfer's kernel spinning forever. It costs an extra tiny kernel and a cross-GPU round
    trip per call, so it is off by default. Decided at creation, identically on every rank."""
    if value is None:
        return arguments.env_bool(_env_var(HANDSHAKE_ENV_VAR))
    return arguments.as_bool("handshake", value, allow_none=True)


def _resolve_seconds(value, *, name: str, env_var: str, default: float, allow_zero: bool) -> float:
    """``value`` seconds, or the float in ``$env_var`` when ``value`` is None (unset or empty:
    ``default``), within (0 or [0 with ``allow_zero``, MAX_TIMEOUT_S]; errors name
    the parameter or the variable."""
    where = name
    if value is None:
        raw = os.environ.get(env_var, "").strip()
        if not raw:
            return default
        where = f"${env_var}"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{where}={raw!r} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where} must be a number of seconds, got {value!r}")
    value = float(value)
    low_ok = value >= 0.0 if allow_zero else value > 0.0
    if not (low_ok and value <= MAX_TIMEOUT_S):  # NaN fails too
        interval = "[0" if allow_zero else "(0"
        zero = " (0: wait forever)" if allow_zero else ""
        raise ValueError(
            f"{where} must be in {interval}, {MAX_TIMEOUT_S:g}] seconds{zero}, got {value!r}"
        )
    return value


def resolve_handshake_timeout_s(value=None) -> float:
    """How long a checked call waits for the other ranks before it traps: ``value`` or
    ``$JAX_FUSEDAR_HANDSHAKE_TIMEOUT_S`` (seconds, default 30). Generous on purpose: a rank whose
    host is legitimately late (compiling, loading) must not be reported as missing."""
    return _resolve_seconds(
        value,
        name="handshake_timeout_s",
        env_var=_env_var(HANDSHAKE_TIMEOUT_ENV_VAR),
        default=DEFAULT_HANDSHAKE_TIMEOUT_S,
        allow_zero=False,
    )


# --- bounded waits inside the kernel (ffi/core/watchdog.h) ------------------------------------

TIMEOUT_ENV_VAR = "JAX_FUSEDAR_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0


def resolve_timeout_s(value=None, name: str = "timeout_s") -> float:
    """How long any wait inside the fused kernel (a peer's Lamport data, a barrier flag, a
    large-message entry or chunk flag) may last before the kernel records what it waited for
    and traps: ``value`` or ``$JAX_FUSEDAR_TIMEOUT_S`` (seconds, default 30; 0 waits
    forever, FlashInfer's own behaviour). Always on: it costs a counter increment per spin
    and a clock read every thousand spins. After a timeout the stream fails with a CUDA
    error, the device's context is unusable, and every later call on the workspace is
    refused with the recorded text (the workspace's ``failures()``/``failure()`` read it).
    Per rank; generous on purpose: a peer that is legitimately late (compiling, loading, a
    long step between calls) must not be reported as missing. ``name``: the parameter errors
    name."""
    return _resolve_seconds(
        value, name=name, env_var=TIMEOUT_ENV_VAR, default=DEFAULT_TIMEOUT_S, allow_zero=True
    )
