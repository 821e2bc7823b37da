"""The public JAX API's functions, in one place: the entries of the op family (``ops/``),
dense and MoE, and the plain-``jit`` entry that partitions the program around the dense op.

* ``allreduce_fusion`` (``ops/dense.py``): FlashInfer's unified ``allreduce_fusion`` in
  functional form, inside ``jax.shard_map``; ``AllReduceFusionOutputs``.
* ``moe_reduction_allreduce_fusion`` (pattern 6) and ``moe_finalize_allreduce_fusion``
  (pattern 7, ``ops/moe.py``): FlashInfer's MoE epilogues; ``MoeAllReduceFusionOutputs``.
* ``row_parallel_allreduce_fusion`` (``ops/partitioning.py``): the dense op from plain
  ``jax.jit`` with shardings.

Every one decides at trace time, from shapes, dtype, world size and the workspace's
metadata only (``ops/plan.py`` over ``common.plan``), so every rank of a group makes the same
choice and the kernel's spin-wait always finds its peers.
"""

from __future__ import annotations

from .ops.dense import AllReduceFusionOutputs, allreduce_fusion
from .ops.moe import (
    MoeAllReduceFusionOutputs,
    moe_finalize_allreduce_fusion,
    moe_reduction_allreduce_fusion,
)
from .ops.partitioning import row_parallel_allreduce_fusion

__all__ = [
    "AllReduceFusionOutputs",
    "MoeAllReduceFusionOutputs",
    "allreduce_fusion",
    "moe_finalize_allreduce_fusion",
    "moe_reduction_allreduce_fusion",
    "row_parallel_allreduce_fusion",
]
