"""torch_compat under FlashInfer's name, for code that imports ``flashinfer.comm`` (vLLM,
SGLang) and should run on torch_compat unchanged.

:func:`install` (also ``torch_compat.install_as_flashinfer()``) puts this package in
``sys.modules`` as ``flashinfer``, and its ``comm`` package as ``flashinfer.comm`` (with the
submodules ``allreduce``, ``trtllm_ar`` and ``mnnvl``), so ``import flashinfer.comm``,
``from flashinfer.comm.mnnvl import TorchDistBackend`` and
``importlib.util.find_spec("flashinfer")`` find them. Call it before the first import of
flashinfer anywhere in the process. Only the all-reduce fusion API is here (docs/torch.md
lists the names and what differs from FlashInfer); everything else of FlashInfer is absent,
so an import of it fails as it does where FlashInfer is not installed.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

log = logging.getLogger("torch_compat")

# The FlashInfer release whose all-reduce fusion API this package follows.
FLASHINFER_API_VERSION = "0.7.2.post1"
# Set on every module of the stand-in, so code (and install) can tell it from FlashInfer.
IS_TORCH_COMPAT = True

_SUBMODULES = ("comm", "comm.allreduce", "comm.trtllm_ar", "comm.mnnvl")


def _ours(module) -> bool:
    return getattr(module, "IS_TORCH_COMPAT", False) is True


def install():
    """Makes ``import flashinfer`` (and ``flashinfer.comm``) give torch_compat; returns the
    ``flashinfer.comm`` module. Idempotent. Raises RuntimeError when the real FlashInfer (or
    anything else under that name) was imported already: code holding it would keep using
    it, so installing then would split the process between two implementations."""
    import importlib

    present = sys.modules.get("flashinfer")
    if present is not None and not _ours(present):
        raise RuntimeError(
            "torch_compat.install_as_flashinfer(): a module named flashinfer is already "
            f"imported ({getattr(present, '__file__', present)!r}); call it before anything "
            "imports flashinfer"
        )
    if present is None and _real_flashinfer_installed():
        log.info("torch_compat stands in for the installed flashinfer package in this process")
    top = sys.modules[__name__]
    sys.modules["flashinfer"] = top
    for sub in _SUBMODULES:
        sys.modules[f"flashinfer.{sub}"] = importlib.import_module(f"{__name__}.{sub}")
    return sys.modules["flashinfer.comm"]


def uninstall() -> None:
    """Removes what :func:`install` put in ``sys.modules`` (modules that imported it keep
    their references)."""
    for name in ["flashinfer"] + [f"flashinfer.{s}" for s in _SUBMODULES]:
        if _ours(sys.modules.get(name)):
            del sys.modules[name]


def installed() -> bool:
    """Whether ``flashinfer`` in this process is torch_compat."""
    return _ours(sys.modules.get("flashinfer"))


def _real_flashinfer_installed() -> bool:
    try:
        return importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        return False


def __getattr__(name: str):
    # `flashinfer.comm` as an attribute: imported on first use, as a submodule would be.
    if name == "comm":
        import importlib

        return importlib.import_module(f"{__name__}.comm")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
