"""The FlashInfer anchor (FlashInfer 0.7.2.post1's own build of the kernel) for GPU tests.

A thin layer over ``tools/flashinfer_anchor.py``, the loader the torch benchmark shares:
where the anchor folder is (``$JAX_FUSEDAR_ANCHOR``, else ``<repo>/.anchor/anchor-flashinfer``),
why it cannot be used, the environment the rank processes must inherit, and its workspace on
the "trtllm" backend only (never "auto": it may choose MNNVL, i.e. NVLink multicast).
"""

from __future__ import annotations

import os
from pathlib import Path

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


path = resolve_anchor_path
problem = anchor_problem  # why the anchor at a path cannot be used (None: it looks complete)
load = load_anchor  # ``flashinfer.comm.allreduce`` from the anchor (raises AnchorUnavailable)
create_workspace = create_anchor_workspace


def prepare_parent(where: Path) -> None:
    """Sets, in the test process, what the spawned ranks must inherit (LD_LIBRARY_PATH only
    takes effect at process start)."""
    os.environ.update(anchor_environment(where))
