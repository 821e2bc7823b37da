"""Options of the opt-in cross-rank call check (ffi/core/call_check.h): whether a new
workspace checks every call and how long a checked call waits (that all members agree is
``join.check_options_agree``'s). Framework-neutral (never imports jax or torch)."""
from __future__ import annotations

import os

import numpy as np

from . import arguments

CHECK_CALLS_ENV_VAR = "JAX_FUSEDAR_CHECK_CALLS"
CHECK_TIMEOUT_ENV_VAR = "JAX_FUSEDAR_CHECK_TIMEOUT_S"
DEFAULT_CHECK_TIMEOUT_S = 30.0
MAX_CHECK_TIMEOUT_S = 3600.0


def resolve_check_calls(value=None) -> bool:
    """Whether a new workspace checks every call across ranks: ``value`` when it is a bool,
    else ``$JAX_FUSEDAR_CHECK_CALLS`` (1/true/yes/on or 0/false/no/off; unset: off;
    ``arguments.env_bool``, the parser of every boolean variable).

    With the check on, each launch first runs a one-block handshake kernel in which the ranks
    compare {call number, pattern, dtype, num_tokens, hidden_dim, one-shot, fp32_acc, layout,
    quant group size}; a mismatch, or a rank that does not arrive within the timeout, makes
    the device print what differs and trap (the stream fails with a CUDA error) instead of
    FlashInfer's kernel spinning forever. It costs an extra tiny kernel and a cross-GPU round
    trip per call, so it is off by default. Decided at creation, identically on every rank."""
    if value is None:
        return arguments.env_bool(CHECK_CALLS_ENV_VAR)
    return arguments.as_bool("check_calls", value, allow_none=True)


def resolve_check_timeout_s(value=None) -> float:
    """How long a checked call waits for the other ranks before it traps: ``value`` or
    ``$JAX_FUSEDAR_CHECK_TIMEOUT_S`` (seconds, default 30). Generous on purpose: a rank whose
    host is legitimately late (compiling, loading) must not be reported as missing."""
    where = "check_timeout_s"
    if value is None:
        raw = os.environ.get(CHECK_TIMEOUT_ENV_VAR, "").strip()
        if not raw:
            return DEFAULT_CHECK_TIMEOUT_S
        where = f"${CHECK_TIMEOUT_ENV_VAR}"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{where}={raw!r} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where} must be a number of seconds, got {value!r}")
    value = float(value)
    if not 0.0 < value <= MAX_CHECK_TIMEOUT_S:  # NaN fails too
        raise ValueError(f"{where} must be in (0, {MAX_CHECK_TIMEOUT_S:g}] seconds, got {value!r}")
    return value
