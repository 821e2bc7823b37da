"""A Llama-architecture decoder in plain JAX, tensor-parallel under ``jax.shard_map``.

It calls nothing from jax_fusedar: it is the model a user already has, which
``jax_fusedar.fuse`` then rewrites. RMSNorm, rotary embeddings (Llama's rotate-half form),
grouped-query attention with a KV cache, SwiGLU MLP; Megatron tensor parallelism over one mesh
axis: q/k/v, gate and up projections split by columns (heads, FFN), o and down projections
by rows (each rank holds a partial sum, all-reduced with ``psum``), the LM head split over the
vocabulary. Layers run unrolled (a Python loop) or under ``lax.scan`` over stacked weights
(MaxText's default).

Each layer is written pre-norm as in Hugging Face's ``LlamaDecoderLayer``, with one choice of
where a norm sits: the norm that follows a layer's second all-reduce (the next layer's input
norm, or the final norm) is computed at the end of that layer rather than at the start of the
next. Under ``lax.scan`` that keeps each all-reduce, its residual add and the RMSNorm that
reads the sum in one scan step, where a jaxpr-level pass can see them together (with the norm
at the top of the next step the pair straddles two iterations). Same math either way.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self, world: int) -> None:
        """ValueError naming what does not split over ``world`` ranks."""
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        for name in ("kv_heads", "heads", "ffn", "vocab"):
            if getattr(self, name) % world:
                raise ValueError(f"{name} {getattr(self, name)} does not split over {world} "
                                 f"tensor-parallel ranks")


# Llama-3-8B's shapes (rope scaling left out: it only changes the frequencies).
LLAMA3_8B = LlamaConfig(vocab=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8,
                        rope_theta=500000.0, rms_eps=1e-5)
# A small one for CPUs: 8 ranks, 2 query heads and 1 KV head each.
TINY = LlamaConfig(vocab=512, hidden=256, ffn=512, layers=2, heads=16, kv_heads=8,
                   rope_theta=10000.0, rms_eps=1e-5)
PRESETS = {"llama3-8b": LLAMA3_8B, "tiny": TINY}


def param_specs(axis: str) -> dict:
    """PartitionSpecs of the global weights (layer weights stacked on a leading axis)."""
    col, row = P(None, None, axis), P(None, axis, None)
    return {"embed": P(), "final_norm": P(), "lm_head": P(None, axis),
            "attn_norm": P(), "mlp_norm": P(), "wq": col, "wk": col, "wv": col, "wo": row,
            "w_gate": col, "w_up": col, "w_down": row}


def param_shapes(cfg: LlamaConfig) -> dict:
    L, H, F, hd = cfg.layers, cfg.hidden, cfg.ffn, cfg.head_dim
    return {"embed": (cfg.vocab, H), "final_norm": (H,), "lm_head": (H, cfg.vocab),
            "attn_norm": (L, H), "mlp_norm": (L, H), "wq": (L, H, cfg.heads * hd),
            "wk": (L, H, cfg.kv_heads * hd), "wv": (L, H, cfg.kv_heads * hd),
            "wo": (L, cfg.heads * hd, H), "w_gate": (L, H, F), "w_up": (L, H, F),
            "w_down": (L, F, H)}


def _fan_in(name, shape):
    return shape[-2] if name not in ("embed",) else 1


def init_params_numpy(cfg: LlamaConfig, seed: int) -> dict:
    """float32 numpy weights: normal / sqrt(fan-in) (activations stay O(1) through the layers),
    norm gains 1 + 0.1 * normal (random, so a gain used at the wrong place shows)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            scale = 1.0 / math.sqrt(_fan_in(name, shape))
            out[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return out


def init_params(cfg: LlamaConfig, mesh, axis: str, dtype, seed: int, *, host: bool = True):
    """Weights as sharded arrays of ``dtype``. ``host``: drawn with numpy (reproducible across
    machines, used by the Hugging Face parity check); else drawn on the devices with
    jax.random directly into their shards (Llama-3-8B's 8 G values in seconds)."""
    specs = param_specs(axis)
    if host:
        arrays = init_params_numpy(cfg, seed)
        return {k: jax.device_put(jnp.asarray(v, dtype), NamedSharding(mesh, specs[k]))
                for k, v in arrays.items()}
    shapes = param_shapes(cfg)
    names = sorted(shapes)
    shardings = {k: NamedSharding(mesh, specs[k]) for k in names}

    @partial(jax.jit, out_shardings=shardings)
    def draw(key):
        keys = dict(zip(names, jax.random.split(key, len(names))))
        out = {}
        for k in names:
            z = jax.random.normal(keys[k], shapes[k], jnp.float32)
            if k.endswith("norm"):
                out[k] = (1.0 + 0.1 * z).astype(dtype)
            else:
                out[k] = (z / math.sqrt(_fan_in(k, shapes[k]))).astype(dtype)
        return out

    return draw(jax.random.key(seed))


def cache_shape(cfg: LlamaConfig, batch: int, length: int) -> tuple:
    return (cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim)


def cache_spec(axis: str):
    return P(None, None, None, axis, None)


def init_cache(cfg, mesh, axis, dtype, batch: int, length: int):
    """Zeroed (k, v) caches, [layers, batch, length, kv_heads, head_dim], split over KV heads."""
    sharding = NamedSharding(mesh, cache_spec(axis))
    make = jax.jit(lambda: jnp.zeros(cache_shape(cfg, batch, length), dtype),
                   out_shardings=sharding)
    return make(), make()


# --- the per-rank model --------------------------------------------------------------------------

def rms_norm(x, gamma, eps):
    """RMSNorm in float32, cast back once (vLLM's and the fused kernel's rounding)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * gamma.astype(jnp.float32)).astype(x.dtype)


def rms_norm_hf(x, gamma, eps):
    """Hugging Face's LlamaRMSNorm: normalized value cast to the input dtype, then gamma
    multiplied in that dtype (two roundings for 16-bit models)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return gamma.astype(x.dtype) * (x32 * inv).astype(x.dtype)


NORMS = {"fused-friendly": rms_norm, "hf": rms_norm_hf}


def rope(x, positions, theta):
    """Rotary embedding, rotate-half form (Hugging Face Llama): x [B, T, heads, hd]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = positions.astype(jnp.float32)[:, :, None] * inv_freq      # [B, T, hd/2]
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    rot = jnp.concatenate([-x32[..., hd // 2:], x32[..., :hd // 2]], -1)
    return (x32 * cos + rot * sin).astype(x.dtype)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def layer(cfg, axis, norm, x, h, lp, ck, cv, pos):
    """One decoder layer on one rank. x: the residual stream, h: its normed copy [B, T, H];
    lp: this layer's weight shards; ck, cv: this layer's cache shard [B, S, kv_local, hd];
    pos: the first position of the T tokens. Returns (x, h, ck, cv) with h already the next
    norm's output (see the module docstring)."""
    B, T, _ = x.shape
    hd = cfg.head_dim
    q = _dot(h, lp["wq"]).reshape(B, T, -1, hd)
    k = _dot(h, lp["wk"]).reshape(B, T, -1, hd)
    v = _dot(h, lp["wv"]).reshape(B, T, -1, hd)
    positions = pos + jnp.arange(T, dtype=jnp.int32)[None, :].repeat(B, 0)
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, pos, 0, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, pos, 0, 0))
    kvl = ck.shape[2]
    group = q.shape[2] // kvl
    qg = q.reshape(B, T, kvl, group, hd).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, ck.astype(jnp.float32)) / math.sqrt(hd)
    S = ck.shape[1]
    visible = jnp.arange(S)[None, :] <= (pos + jnp.arange(T))[:, None]     # causal, [T, S]
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("bkgts,bskd->btkgd", probs, cv.astype(jnp.float32))
    attn = attn.reshape(B, T, -1).astype(x.dtype)
    x = jax.lax.psum(_dot(attn, lp["wo"]), axis) + x                        # row-parallel
    h = norm(x, lp["mlp_norm"], cfg.rms_eps)
    act = jax.nn.silu(_dot(h, lp["w_gate"]).astype(jnp.float32)).astype(x.dtype)
    mlp = _dot(act * _dot(h, lp["w_up"]), lp["w_down"])
    x = jax.lax.psum(mlp, axis) + x                                         # row-parallel
    h = norm(x, lp["next_norm"], cfg.rms_eps)
    return x, h, ck, cv


LAYER_KEYS = ("attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def forward_local(cfg, axis, params, tokens, ck, cv, pos, *, scan: bool, norm=rms_norm):
    """The per-rank forward pass: tokens [B, T] int32 at positions pos..pos+T-1. Returns
    (this rank's vocabulary slice of the logits [B, T, V/tp] float32, caches)."""
    x = jnp.take(params["embed"], tokens, axis=0)
    h = norm(x, params["attn_norm"][0], cfg.rms_eps)
    stacked = {k: params[k] for k in LAYER_KEYS}
    # The gain of the norm each layer ends with: the next layer's input norm, then the final.
    stacked["next_norm"] = jnp.concatenate([params["attn_norm"][1:], params["final_norm"][None]])
    if scan:
        def step(carry, xs):
            x, h = carry
            lp, k1, v1 = xs
            x, h, k1, v1 = layer(cfg, axis, norm, x, h, lp, k1, v1, pos)
            return (x, h), (k1, v1)
        (x, h), (ck, cv) = jax.lax.scan(step, (x, h), (stacked, ck, cv))
    else:
        ks, vs = [], []
        for i in range(cfg.layers):
            lp = {k: v[i] for k, v in stacked.items()}
            x, h, k1, v1 = layer(cfg, axis, norm, x, h, lp, ck[i], cv[i], pos)
            ks.append(k1)
            vs.append(v1)
        ck, cv = jnp.stack(ks), jnp.stack(vs)
    logits = jnp.einsum("bth,hv->btv", h, params["lm_head"], preferred_element_type=jnp.float32)
    return logits, ck, cv


def make_forward(cfg, mesh, axis, *, scan: bool, norm=rms_norm):
    """forward(params, tokens, ck, cv, pos) -> (logits [B, T, V] float32, ck, cv): the
    shard_map over ``axis`` (not jitted: wrap it in jax.jit, or in jax_fusedar.fuse)."""
    specs = param_specs(axis)
    body = partial(forward_local, cfg, axis, scan=scan, norm=norm)
    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(specs, P(), cache_spec(axis), cache_spec(axis), P()),
        out_specs=(P(None, None, axis), cache_spec(axis), cache_spec(axis)))


def greedy_decode(prefill, decode, params, prompt, ck, cv, steps: int):
    """Prefill ``prompt`` [B, T], then ``steps`` greedy tokens. Returns (tokens [B, steps],
    the logits of every step [steps, B, V] as numpy float32)."""
    T = prompt.shape[1]
    logits, ck, cv = prefill(params, prompt, ck, cv, jnp.int32(0))
    last = logits[:, -1]
    toks, all_logits = [], []
    for i in range(steps):
        all_logits.append(np.asarray(last, np.float32))
        tok = jnp.argmax(last, axis=-1).astype(jnp.int32)
        toks.append(np.asarray(tok))
        logits, ck, cv = decode(params, tok[:, None], ck, cv, jnp.int32(T + i))
        last = logits[:, -1]
    return np.stack(toks, 1), np.stack(all_logits)
