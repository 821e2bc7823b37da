"""The FlashInfer anchor (FlashInfer 0.7.2.post1's own build of the kernel) for GPU tests.

A thin layer over ``tools/flashinfer_anchor.py``, the loader the torch benchmark shares:
where the anchor folder is (``$JAX_FUSEDAR_ANCHOR``, else ``<repo>/.anchor/anchor-flashinfer``),
why it cannot be used, the environment the rank processes must inherit, and its workspace on
the "trtllm" backend only (never "auto": it may choose MNNVL, i.e. NVLink multicast).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from tools.flashinfer_anchor import (
    ANCHOR_ENV_VAR,
    DEFAULT_ANCHOR,
    AnchorUnavailable,
    anchor_environment,
    anchor_problem,
    create_anchor_workspace,
    load_anchor,
    resolve_anchor_path,
)

__all__ = [
    "ANCHOR_ENV_VAR",
    "DEFAULT_ANCHOR",
    "AnchorUnavailable",
    "create_workspace",
    "load",
    "path",
    "prepare_parent",
    "problem",
]


def path(explicit: Optional[str] = None) -> Path:
    return resolve_anchor_path(explicit)


def problem(where: Path) -> Optional[str]:
    """Why the anchor at ``where`` cannot be used (None: it looks complete)."""
    return anchor_problem(where)


def prepare_parent(where: Path) -> None:
    """Sets, in the test process, what the spawned ranks must inherit (LD_LIBRARY_PATH only
    takes effect at process start)."""
    os.environ.update(anchor_environment(where))


def load(where) -> object:
    """``flashinfer.comm.allreduce`` from the anchor (raises AnchorUnavailable)."""
    return load_anchor(where)


def create_workspace(fi, **kw):
    return create_anchor_workspace(fi, **kw)
