"""Strict checks of option values and boolean environment variables, one of each kind.

Framework-neutral (stdlib + numpy): the JAX API, ``torch_compat`` and the CLI all take their
options through these, so ``use_oneshot="false"``, ``fp32_acc="no"``, ``layout_code=2.7`` or
``rms_eps=None`` fail the same way everywhere, naming the argument, instead of being coerced
by ``bool()``/``int()``/``float()`` into something else (``bool("false")`` is True).
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Mapping, Optional

import numpy as np

_BOOLS = (bool, np.bool_)


def is_int(value: object) -> bool:
    """A Python or numpy integer, and not a bool (True as a count or a code is a bug)."""
    if type(value) is int:  # the common case, without numbers.Integral's ABC check
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, _BOOLS)


def as_bool(name: str, value, *, allow_none: bool = False) -> Optional[bool]:
    """``value`` if it is a real bool (Python or numpy), None if allowed; TypeError naming
    ``name`` otherwise (strings, ints and other truthy objects are refused)."""
    if value is None and allow_none:
        return None
    if isinstance(value, _BOOLS):
        return bool(value)
    allowed = "True, False or None" if allow_none else "True or False"
    raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")


def as_float(name: str, value, *, minimum: Optional[float] = None) -> float:
    """``value`` as a finite float: a Python or numpy real number (not a bool, a string, a
    complex number or an array), at least ``minimum`` when given."""
    # The common case first (a Python float or int): numbers.Real is an ABC whose
    # isinstance check costs microseconds, and torch_compat runs this on every eager call.
    if type(value) is not float and type(value) is not int and (
            isinstance(value, _BOOLS) or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result}")
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def as_int(name: str, value, *, minimum: Optional[int] = None) -> int:
    """``value`` as an int: a Python or numpy integer (not a bool or a float), at least
    ``minimum`` when given."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    result = int(value)
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def env_bool(var: str, env: Optional[Mapping[str, str]] = None, *, default: bool = False) -> bool:
    """The boolean environment variable ``var`` (``env`` defaults to os.environ): 1/true/yes/on
    or 0/false/no/off in any case; unset or empty gives ``default``; anything else is a
    ValueError naming the variable (a typo must not silently mean "off")."""
    env = os.environ if env is None else env
    raw = env.get(var)
    word = "" if raw is None else raw.strip().lower()
    if word == "":
        return default
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"${var}={raw!r} is not a boolean: use {'/'.join(TRUE_WORDS)} or "
                     f"{'/'.join(FALSE_WORDS)} (or leave it unset)")
