"""The Equinox module of the fused all-reduce + residual add + RMSNorm:
``jax_fusedar.equinox.ResidualRMSNorm`` (the Flax ones are in ``jax_fusedar.flax``).

Called on one rank's shard inside ``jax.shard_map`` over the workspace's axis, on a single
token (``[hidden]``, Equinox's convention: ``jax.vmap`` it over tokens, and the vmap folds the
tokens into one fused call) or on ``[..., hidden]`` rows. The call is
``jax_fusedar.allreduce_fusion`` itself, so it decides, refuses and falls back exactly as that
does (docs/jax_api.md). docs/frameworks.md shows it in a decoder layer.
"""

from __future__ import annotations

try:
    import equinox  # noqa: F401
except ModuleNotFoundError as e:  # only a missing Equinox is the extra's business
    if (e.name or "").split(".")[0] != "equinox":
        raise
    raise ImportError(
        "jax_fusedar.equinox needs Equinox: pip install 'jax_fusedar[equinox]'"
    ) from e

from .modules import ResidualRMSNorm  # noqa: E402

__all__ = ["ResidualRMSNorm"]
