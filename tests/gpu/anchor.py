"""The FlashInfer anchor (FlashInfer 0.7.2.post1's own build of the kernel) for GPU tests, over
``tools/flashinfer_anchor.py``: at ``$JAX_FUSEDAR_ANCHOR``, else ``.anchor/anchor-flashinfer``;
its workspace on the "trtllm" backend only (never "auto": it may choose NVLink multicast)."""

from __future__ import annotations

import os
from pathlib import Path

from tools.flashinfer_anchor import ANCHOR_ENV_VAR, DEFAULT_ANCHOR, AnchorUnavailable
from tools.flashinfer_anchor import anchor_environment, anchor_problem, create_anchor_workspace
from tools.flashinfer_anchor import load_anchor, resolve_anchor_path

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


def prepared():
    """(path, None) with prepare_parent done, or (None, why the anchor cannot be used)."""
    where = path()
    why = problem(where)
    if why:
        return None, why
    prepare_parent(where)
    return where, None


def check_rank(r, world, *, scales=True):
    """One rank's sweep against a reference (workers/anchor_compare.py): every output byte
    equal and written, both within the float64 oracle's bounds (and ``scales``')."""
    from tests.gpu.harness import bound_problems

    print(
        f"rank {r['rank']} (GPU {r['device']}): {r['cases']} cases, {r['calls']} calls in "
        f"{r['seconds']:.1f} s against {r['anchor_module']}"
    )
    assert not r["refused"], f"rank {r['rank']} calls refused: {r['refused']}"
    assert r["cases"] > 0 and r["calls"] > 0 and not r["return_mismatch"], r
    differing = {k: d for k, d in r["diffs"].items() if d["differing"]}
    assert not differing, f"rank {r['rank']}: outputs differ from the reference's: {differing}"
    assert r["unwritten"] == {"ours": 0, "anchor": 0}, r["unwritten"]
    for dtype, per_impl in r["oracle"].items():
        for impl, st in per_impl.items():
            where = f"rank {r['rank']} {dtype} {impl}: {st}"
            assert not bound_problems(st, dtype, world), where
            assert st["allreduce_bound"] > 0 and st["norm_own"] > 0, where  # measured
            assert st["elements"] > 0 and st["worse"] == 0, where
            if scales:
                assert st["dyn_scale_ulps"] <= 2.0, where
                assert st["group_scale_mismatch"] == 0, where
