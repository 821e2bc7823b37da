"""What the style models share: their size, initial weights, rotary embeddings, causal
attention, and their layout on a mesh of ("dp", "tp") axes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


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


def draw(rng, dtype, norm_dtype=None, **weights):
    """The weights drawn in order: an int n is a norm weight of n around 1 (in
    ``norm_dtype``, if given), a (shape, fan_in) pair a matrix (``normal``)."""
    return {
        k: gamma(rng, v, norm_dtype or dtype) if isinstance(v, int) else normal(rng, *v, dtype)
        for k, v in weights.items()
    }


def llama_layers(cfg: Config, rng, dtype, names, norm_dtype=None):
    """Each layer's weights drawn under ``names`` in this order: the attention norm, q, k, v,
    o (heads * head_dim wide), the MLP norm, gate, up, down."""
    d, f, qd = cfg.hidden, cfg.ffn, cfg.heads * cfg.head_dim
    col, row = ((d, qd), d), ((qd, d), qd)
    shapes = [d, col, col, col, row, d, ((d, f), d), ((d, f), d), ((f, d), f)]
    return [draw(rng, dtype, norm_dtype, **dict(zip(names, shapes))) for _ in range(cfg.layers)]


def activations(cfg: Config, seed: int, dtype):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((cfg.batch, cfg.seq, cfg.hidden)).astype(np.float32).astype(dtype)


def rope(x, positions, theta=10000.0):
    """Rotate-half rotary embedding of x [batch, time, heads, head_dim], in float32."""
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


def self_attention(h, wq, wk, wv, head_dim, project=jnp.matmul):
    """Causal self-attention with rotary embeddings on h [batch, time, hidden], projected by
    ``project(h, w)``: [batch, time, heads * head_dim], before the output projection."""
    b, t, _ = h.shape
    q, k, v = (project(h, w).reshape(b, t, -1, head_dim) for w in (wq, wk, wv))
    pos = jnp.arange(t)
    return causal_attention(rope(q, pos), rope(k, pos), v).reshape(b, t, -1)


def place_layers(params, mesh, specs, layers="layers"):
    """``params`` on ``mesh``: ``params[layers]``'s entries by ``specs``, the rest replicated."""
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))

    placed = {k: put(v, P()) for k, v in params.items() if k != layers}
    placed[layers] = [{k: put(v, specs[k]) for k, v in p.items()} for p in params[layers]]
    return placed


def input_sharding(mesh):
    """Activations [batch, seq, hidden] split over the data-parallel axis."""
    return NamedSharding(mesh, P("dp"))
