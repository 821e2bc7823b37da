"""Loads the native extension (_fusedar) when it was built; framework-neutral
(never imports jax or torch).

The extension is the layer below this one (ffi/python: the XLA FFI handlers and the
bindings of the C core), so this layer owns its loading: the module is loaded here, by path,
as ``jax_fusedar.common._fusedar``, and every user reaches it through ``ext`` / ``require()``.
Its file stays where the build installs it, the package's own folder (``_fusedar*.so`` next
to ``libfusedar_core.so``, which it finds through its ``$ORIGIN`` rpath): the CMake install
rule, the wheel and ``./dev``'s install into the checkout all put it there. No module names
it in an import statement (tests/common/test_no_framework_imports.py), so the import graph
has no edge from the rules layer up to the package root.

A package built without a CUDA compiler has no extension: the fused op then runs its
reference path everywhere, and asking for the kernel raises an error saying why.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Optional

# The folder the build installs the extension into, and the name it is loaded under here.
# The name's last part must stay _fusedar: CPython calls the module's PyInit__fusedar.
EXTENSION_DIR = Path(__file__).resolve().parent.parent
MODULE_NAME = f"{__name__.rpartition('.')[0]}._fusedar"


def extension_path() -> Optional[Path]:
    """The built extension's file, or None: the first of the interpreter's extension
    suffixes present (its own ABI tag, then abi3, then plain .so), as ``import`` would
    search the folder."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = EXTENSION_DIR / f"_fusedar{suffix}"
        if path.is_file():
            return path
    return None


def _load():
    """The extension module, loaded once per process (``sys.modules`` keeps it; a None there
    blocks it, as for an import: a test's stand-in for a build without the extension)."""
    if MODULE_NAME in sys.modules:
        if sys.modules[MODULE_NAME] is None:
            raise ImportError(f"import of {MODULE_NAME} halted; None in sys.modules")
        return sys.modules[MODULE_NAME]
    path = extension_path()
    if path is None:
        raise ImportError(
            f"no _fusedar extension in {EXTENSION_DIR} (looked for _fusedar with the "
            f"suffixes {', '.join(importlib.machinery.EXTENSION_SUFFIXES)})"
        )
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)  # dlopen + PyInit: ImportError if broken
    sys.modules[MODULE_NAME] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE_NAME]
        raise
    return module


try:
    ext = _load()
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
