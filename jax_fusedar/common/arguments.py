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
from typing import Mapping, NamedTuple, Optional

import numpy as np

_BOOLS = (bool, np.bool_)


def is_int(value: object) -> bool:
    """A Python or numpy integer, and not a bool (True as a count or a code is a bug)."""
    if type(value) is int:  # the common case, without numbers.Integral's ABC check
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, _BOOLS)


# Sizes known only when the program runs, by (top-level package, type name): torch's SymInt
# (torch.compile with dynamic shapes) and jax.export's symbolic dimensions. Told apart by
# type because this layer imports neither framework.
_SYMBOLIC_TYPES = {("torch", "SymInt"), ("jax", "_DimExpr")}


def is_symbolic(value: object) -> bool:
    """Whether ``value`` is a symbolic size (``_SYMBOLIC_TYPES``): arithmetic on it works,
    but reading its value (``int()``, a comparison) would fix it to one number, so checks of
    it wait for the run that sees the real size."""
    t = type(value)
    return (t.__module__.partition(".")[0], t.__name__) in _SYMBOLIC_TYPES


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
    if (
        type(value) is not float
        and type(value) is not int
        and (isinstance(value, _BOOLS) or not isinstance(value, numbers.Real))
    ):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result}")
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


# The largest finite float32. The kernel reads rms_eps, weight_bias and the MoE
# routed_scaling_factor as float32 (ffi/core/include/fusedar/core.h), so a float64 value
# past it becomes inf there: the output would silently be zeros or inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def as_float32(name: str, value, *, minimum: Optional[float] = None) -> float:
    """``as_float``, and finite in float32, the dtype the kernel (and the reference path's
    float32 math) reads it in: ``rms_eps=1e39`` is refused, not turned into inf. Returned
    as the Python float given (rounding to float32 happens where the value is used)."""
    result = as_float(name, value, minimum=minimum)
    with np.errstate(over="ignore"):  # the overflow is the answer, not a warning
        rounded = float(np.float32(result))
    if not math.isfinite(rounded):
        raise ValueError(
            f"{name}={result!r} overflows float32 (the kernel computes in "
            f"float32, whose largest finite value is {FLOAT32_MAX:.7g})"
        )
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


class FusionOptions(NamedTuple):
    """The scalar options of a fused all-reduce call, as the kernel takes them."""

    rms_eps: float
    weight_bias: float
    fp32_acc: bool
    use_oneshot: Optional[bool]  # None: chosen by size


def fusion_options(*, rms_eps, weight_bias, fp32_acc, use_oneshot) -> FusionOptions:
    """The options every JAX entry point of the fused op validates, once and alike
    (``allreduce_fusion``, ``row_parallel_allreduce_fusion``): real bools, and ``rms_eps``
    (>= 0) and ``weight_bias`` finite in float32."""
    return FusionOptions(
        rms_eps=as_float32("rms_eps", rms_eps, minimum=0.0),
        weight_bias=as_float32("weight_bias", weight_bias),
        fp32_acc=as_bool("fp32_acc", fp32_acc),
        use_oneshot=as_bool("use_oneshot", use_oneshot, allow_none=True),
    )


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
    raise ValueError(
        f"${var}={raw!r} is not a boolean: use {'/'.join(TRUE_WORDS)} or "
        f"{'/'.join(FALSE_WORDS)} (or leave it unset)"
    )
