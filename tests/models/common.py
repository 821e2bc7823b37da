"""What the style models share: their size, initial weights, rotary embeddings and the
attention core (causal softmax attention on [batch, time, heads, head_dim])."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 2
    seq: int = 8
    hidden: int = 64
    heads: int = 8
    head_dim: int = 8
    ffn: int = 128
    layers: int = 2
    eps: float = 1e-6

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def normal(rng, shape, fan_in, dtype):
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32).astype(dtype)


def gamma(rng, n, dtype, around=1.0):
    return (around + 0.1 * rng.standard_normal(n)).astype(np.float32).astype(dtype)


def activations(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((cfg.batch, cfg.seq, cfg.hidden)).astype(np.float32).astype(dtype)


def rope(x, positions, theta=10000.0):
    """Rotate-half rotary embedding of x [batch, time, heads, head_dim] (computed in
    float32)."""
    d = x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    half = d // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v on [batch, time, heads, head_dim], causal, in float32."""
    t = q.shape[1]
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32))
    scores = scores / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v.astype(jnp.float32)).astype(q.dtype)
