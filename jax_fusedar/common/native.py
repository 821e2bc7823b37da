"""Loads the native extension (_fusedar) when it was built; framework-neutral
(never imports jax or torch).

A package built without a CUDA compiler has no extension: the fused op then runs its
reference path everywhere, and asking for the kernel raises an error saying why.
"""

from __future__ import annotations

from typing import Optional

try:
    from jax_fusedar import _fusedar as ext

    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as e:  # built without CUDA, or not built at all (source checkout)
    ext = None
    _IMPORT_ERROR = e

DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

# The XLA FFI targets by role (ffi/xla/handlers.h; ext.ffi_target_names() must equal this).
# Versioned: a serialized program names the handler it was built for.
FFI_TARGETS = {
    "allreduce_fusion": "jax_fusedar_allreduce_fusion_v2",
    "moe_allreduce_fusion": "jax_fusedar_moe_allreduce_fusion_v1",
    "device_timestamp": "jax_fusedar_device_timestamp_v1",
}


def available() -> bool:
    return ext is not None


def unavailable_reason() -> Optional[str]:
    """Why the extension did not load (the import error's first line), or None."""
    if ext is not None:
        return None
    return str(_IMPORT_ERROR).splitlines()[0] if _IMPORT_ERROR else "not built"


def require():
    """Returns the extension module or raises a RuntimeError explaining how to get it."""
    if ext is None:
        raise RuntimeError(
            "jax_fusedar's native extension is not available "
            f"({_IMPORT_ERROR}); build the package with a CUDA compiler (nvcc) on PATH, "
            "see the README's install section"
        ) from _IMPORT_ERROR
    return ext


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without a driver or without the extension)."""
    if ext is None:
        return 0
    try:
        return ext.device_count()
    except RuntimeError:
        return 0
