"""Flax modules of the fused all-reduce + residual add + RMSNorm, for the residual stream
after a row-parallel projection (the attention's output projection, the MLP's down
projection).

``jax_fusedar.flax.ResidualRMSNorm`` is the Linen module, ``jax_fusedar.flax.nnx.ResidualRMSNorm``
the NNX one (``jax_fusedar.equinox.ResidualRMSNorm`` is Equinox's). Each owns its gamma
parameter, named ``scale`` as in Flax's and MaxText's RMSNorm, with the logical axis names
Flax's partitioning reads, and is called on one rank's shard inside ``jax.shard_map`` over
the workspace's axis: ``residual_out, norm_out = norm(partial, residual)``, ``partial`` the
rank's unreduced ``[..., hidden]`` partial sum. The call is ``jax_fusedar.allreduce_fusion``
itself, so it decides, refuses and falls back exactly as that does (docs/jax_api.md), and
works under ``jit``, ``grad``, ``vmap``, ``scan`` and ``remat`` as it does. docs/frameworks.md
shows them in decoder layers.
"""

from __future__ import annotations

try:
    import flax  # noqa: F401
except ModuleNotFoundError as e:  # only a missing Flax is the extra's business
    if (e.name or "").split(".")[0] != "flax":
        raise
    raise ImportError("jax_fusedar.flax needs Flax: pip install 'jax_fusedar[flax]'") from e

from .linen import ResidualRMSNorm  # noqa: E402

__all__ = ["ResidualRMSNorm", "nnx"]


def __getattr__(name):
    # The NNX module loads on first use: a Linen user does not pay for flax.nnx's import.
    if name == "nnx":
        import importlib

        return importlib.import_module(f"{__name__}.nnx")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
