"""jax_fusedar: FlashInfer's fused all-reduce + residual add + RMSNorm for JAX (XLA FFI).

The JAX API is loaded lazily so that the framework-neutral layer (``jax_fusedar.common``:
patterns, limits, sizing, native, ...) can be imported, e.g. by ``torch_compat``, without
importing JAX.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .common import environment as _environment
from .common.patterns import AllReduceFusionPattern, QuantizationSFLayout  # noqa: F401 (no jax)
from .common.sizing import workspace_bytes  # noqa: F401 (no jax)

# A misspelled JAX_FUSEDAR_* variable would be ignored silently: named here, once per process
# (torch_compat and the CLI import this package too).
_environment.warn_unknown(stacklevel=2)

_LAZY = {
    "allreduce_fusion": ("api", "allreduce_fusion"),
    "AllReduceFusionOutputs": ("api", "AllReduceFusionOutputs"),
    "create_allreduce_fusion_workspace": ("workspace", "create_allreduce_fusion_workspace"),
    "abstract_workspace": ("workspace", "abstract_workspace"),
    "row_parallel_allreduce_fusion": ("api", "row_parallel_allreduce_fusion"),
    "export": ("export", None),  # the module: export(), deserialize(), DISABLED_CHECKS
    "timing": ("ops.timing", None),  # the module: device_timestamp(), stamps_to_ns(), available()
    "AllReduceFusionWorkspace": ("workspace", "AllReduceFusionWorkspace"),
    "fuse": ("fusion.transform", "fuse"),
    "FusionReport": ("fusion.report", "FusionReport"),
    "moe_reduction_allreduce_fusion": ("api", "moe_reduction_allreduce_fusion"),
    "moe_finalize_allreduce_fusion": ("api", "moe_finalize_allreduce_fusion"),
    "MoeAllReduceFusionOutputs": ("api", "MoeAllReduceFusionOutputs"),
}

__all__ = ["AllReduceFusionPattern", "QuantizationSFLayout", "workspace_bytes", *_LAZY]


# JAX is an extra (numpy is the only hard dependency), so the package itself imports
# without it: torch users need only its framework-neutral modules.
NEEDS_JAX = "jax_fusedar's JAX API needs JAX: pip install 'jax_fusedar[jax]'"


# The oldest JAX the API runs on: pyproject.toml's minimum (tests/test_install.py keeps the
# two equal). Older releases lack what it uses (jax.lax.pcast, JAX 0.8.2).
MIN_JAX = "0.8.2"


def _is_missing_jax(error: ModuleNotFoundError) -> bool:
    return (error.name or "").split(".")[0] in ("jax", "jaxlib")


def _release(version: str) -> tuple:
    """(0, 8, 2) for "0.8.2", "0.8.2.dev20250101", "0.8.2rc1"."""
    import re

    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _check_jax_version() -> None:
    """Raises ImportError naming the version needed when the installed JAX is too old (an
    old JAX would otherwise fail later with an AttributeError deep inside)."""
    from importlib import metadata

    try:
        found = metadata.version("jax")
    except metadata.PackageNotFoundError:
        return  # not installed: the import below says how to get it
    if _release(found) < _release(MIN_JAX):
        raise ImportError(
            f"jax_fusedar's JAX API needs JAX >= {MIN_JAX}, found jax {found}: "
            f"pip install -U 'jax>={MIN_JAX}'"
        )


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        _check_jax_version()
        try:
            mod = importlib.import_module(f".{module}", __name__)
        except ModuleNotFoundError as e:
            if _is_missing_jax(e):
                raise ImportError(f"{NEEDS_JAX} (jax_fusedar.{name}: {e})") from e
            raise
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jax_fusedar' has no attribute {name!r}")


def __dir__():
    # The lazy exports are attributes too (tab completion, dir(jax_fusedar)).
    return sorted(set(globals()) | set(_LAZY))
