"""docs/frameworks.md's MaxText-style Linen layer (``nn.scan`` over ``nn.remat``, logical axis
names, in ``shard_map``) as the page runs it, with ``jax_fusedar.flax.ResidualRMSNorm`` and
with a twin module that writes what it replaces in plain JAX (``psum`` + residual add +
RMSNorm in float32, gamma rounded to the activations' dtype). ``fuse`` runs on the twin (how
far the pass reaches into such a layer); the module's outputs are compared with the twin's."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp

from tests.repo import REPO

from .lane import Built, LaneModel

PAGE = REPO / "docs" / "frameworks.md"


def plain_twin_module():
    """A stand-in for ``jax_fusedar.flax`` whose ResidualRMSNorm is the plain math."""
    from flax import linen as nn

    class ResidualRMSNorm(nn.Module):
        workspace: object
        axis_name: object = None
        epsilon: float = 1e-6
        kernel_axes: tuple = ("norm",)

        @nn.compact
        def __call__(self, partial, residual):
            scale = self.param(
                "scale",
                nn.with_logical_partitioning(nn.initializers.ones, self.kernel_axes),
                (partial.shape[-1],),
                jnp.float32,
            )
            r = jax.lax.psum(partial, self.axis_name or self.workspace.axis_name) + residual
            r32 = r.astype(jnp.float32)
            inv = jax.lax.rsqrt(jnp.mean(r32 * r32, axis=-1, keepdims=True) + self.epsilon)
            gamma = scale.astype(r.dtype).astype(jnp.float32)
            return r, (r32 * inv * gamma).astype(r.dtype)

    return types.SimpleNamespace(ResidualRMSNorm=ResidualRMSNorm)


def page_layer(twin: bool) -> dict:
    """The namespace of the page's first block, run with the real modules or the twin."""
    block = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.M | re.S)[0]
    if twin:
        block = block.replace("import jax_fusedar.flax as jff\n", "")
    ns = {"__name__": "frameworks_page"}
    if twin:
        ns["jff"] = plain_twin_module()
    exec(compile(block, str(PAGE), "exec"), ns)
    return ns


def build(twin: bool = True, layers: int = 2) -> Built:
    if layers != 2:
        raise ValueError("the model of docs/frameworks.md's page has 2 layers")
    ns = page_layer(twin)
    return Built(ns["decoder"], ns["params"], (ns["x"],), ns["mesh"], "tensor")


HOW = (
    "per layer, the attention's out-projection and the MLP's down-projection (psum of the "
    "partial sums in shard_map) each + residual add + the norm after it (the layer closes "
    "with the next layer's norm)"
)

MODELS = [
    LaneModel(
        "jax_fusedar.flax MaxText-style layer, plain twin (nn.scan + nn.remat)",
        "flax",
        2,
        HOW,
        build,
    )
]
