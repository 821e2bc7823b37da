"""FlashInfer's own build of the kernel (the "anchor", FlashInfer 0.7.2.post1): where it is,
why it cannot be used, the environment it needs, and its loader. A measuring instrument of
this repository (``python -m benchmarks.torch_bench`` and the GPU tests compare against it), not
part of the package: it is imported as ``tools.flashinfer_anchor`` from the checkout.

The anchor folder: ``--anchor``, else ``$JAX_FUSEDAR_ANCHOR``, else
``<repository>/.anchor/anchor-flashinfer`` (this file's ``../.anchor``).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path
from typing import Dict, Mapping, Optional

# NVLink multicast stays off in every process that loads the anchor (docs/decisions.md):
# forced, not defaulted, so a stray setting in the caller's environment cannot turn it on.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

ANCHOR_ENV_VAR = "JAX_FUSEDAR_ANCHOR"
REPO_ROOT = Path(__file__).resolve().parents[1]  # tools/ is never installed
DEFAULT_ANCHOR = REPO_ROOT / ".anchor" / "anchor-flashinfer"
ANCHOR_CUDA_ARCH = "9.0a"  # its trtllm_comm module is prebuilt for sm_90a only
# The CUDA runtime libraries its prebuilt module links against.
CUDA_LIB_DIR = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64")
# What the loader needs inside the anchor folder.
_ANCHOR_ENTRIES = ("flashinfer/comm/allreduce.py", "flashinfer/jit/core.py", "site/tvm_ffi", "ws")


class AnchorUnavailable(RuntimeError):
    """The FlashInfer anchor cannot be loaded here; the message says why and what to set."""


def resolve_anchor_path(
    explicit: Optional[str] = None, env: Optional[Mapping[str, str]] = None
) -> Path:
    """--anchor, else $JAX_FUSEDAR_ANCHOR, else <repo>/.anchor/anchor-flashinfer."""
    env = os.environ if env is None else env
    chosen = explicit or env.get(ANCHOR_ENV_VAR) or DEFAULT_ANCHOR
    return Path(chosen).expanduser().resolve()


def anchor_problem(path: Path) -> Optional[str]:
    """Why the anchor folder at ``path`` cannot be used, or None when it looks complete."""
    path = Path(path)
    if not path.is_dir():
        return f"no anchor folder at {path}"
    missing = [e for e in _ANCHOR_ENTRIES if not (path / e).exists()]
    if missing:
        return f"{path} is not an anchor-flashinfer folder (missing {', '.join(missing)})"
    if not any((path / "ws").rglob("trtllm_comm*.so")):
        return f"{path / 'ws'} holds no prebuilt trtllm_comm module"
    return None


def anchor_environment(path: Path, env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Variables the anchor needs, to set before it is imported (and, for LD_LIBRARY_PATH,
    before the process that loads it starts: set them in the parent before spawning)."""
    env = os.environ if env is None else env
    libs = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if CUDA_LIB_DIR not in libs:
        libs.append(CUDA_LIB_DIR)
    return {
        "FLASHINFER_WORKSPACE_BASE": str(Path(path) / "ws"),
        "FLASHINFER_CUDA_ARCH_LIST": ANCHOR_CUDA_ARCH,
        "LD_LIBRARY_PATH": os.pathsep.join(libs),
        **NO_MULTICAST_ENV,
    }


def unavailable(path: Path, why: str) -> AnchorUnavailable:
    return AnchorUnavailable(
        f"FlashInfer anchor unavailable: {why}. Pass --anchor PATH or set ${ANCHOR_ENV_VAR} to "
        f"the anchor-flashinfer folder (default {DEFAULT_ANCHOR})."
    )


def load_anchor(path=None):
    """Imports the anchor's ``flashinfer.comm.allreduce`` and returns it.

    As its README does: the site/ folder (tvm_ffi for Python 3.12) goes on sys.path, the
    ``flashinfer`` and ``flashinfer.comm`` packages become empty stubs (their __init__s import
    far more than the trimmed copy holds), and JIT builds are disabled so the prebuilt module is
    used. Raises AnchorUnavailable (never ImportError) with the reason. Use a fresh process:
    another ``flashinfer`` already imported is refused.
    """
    path = resolve_anchor_path(None if path is None else str(path))
    problem = anchor_problem(path)
    if problem:
        raise unavailable(path, problem)
    package_dir = str(path / "flashinfer")
    loaded = sys.modules.get("flashinfer")
    if loaded is not None:
        if list(getattr(loaded, "__path__", [])) != [package_dir]:
            raise unavailable(
                path,
                "another 'flashinfer' is already imported in this process "
                f"(from {list(getattr(loaded, '__path__', []))}); load the "
                "anchor in a fresh process",
            )
        return importlib.import_module("flashinfer.comm.allreduce")
    os.environ.update(anchor_environment(path))
    site = str(path / "site")
    if site not in sys.path:
        sys.path.insert(0, site)
    for name, sub in (("flashinfer", "flashinfer"), ("flashinfer.comm", "flashinfer/comm")):
        stub = types.ModuleType(name)
        stub.__path__ = [str(path / sub)]
        sys.modules[name] = stub
    try:
        core = importlib.import_module("flashinfer.jit.core")
        core.JitSpecNvcc.build = _never_build  # the prebuilt module only, never nvcc
        return importlib.import_module("flashinfer.comm.allreduce")
    except Exception as e:
        for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
            del sys.modules[name]
        raise unavailable(path, f"importing it failed: {type(e).__name__}: {e}") from e


def _never_build(self, *args, **kwargs):
    return None


def create_anchor_workspace(fi, *, world_size, rank, max_token_num, hidden_dim, dtype, group):
    """FlashInfer's workspace, always on the "trtllm" backend ("auto" reads the hardware
    multicast attribute and may choose MNNVL, which calls cuMulticastCreate)."""
    return fi.create_allreduce_fusion_workspace(
        backend="trtllm",
        world_size=world_size,
        rank=rank,
        max_token_num=max_token_num,
        hidden_dim=hidden_dim,
        dtype=dtype,
        group=group,
    )
