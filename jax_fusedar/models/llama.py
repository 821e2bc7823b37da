"""A Llama-architecture decoder in plain JAX, tensor-parallel under ``jax.shard_map``.

It calls nothing from jax_fusedar: it is the model a user already has, which
``jax_fusedar.fuse`` then rewrites. RMSNorm, rotary embeddings (Llama's rotate-half form),
grouped-query attention with a KV cache, SwiGLU MLP; Megatron tensor parallelism over one mesh
axis: q/k/v, gate and up projections split by columns (heads, FFN), o and down projections
by rows (each rank holds a partial sum, all-reduced with ``psum``), the LM head split over the
vocabulary (or, with ``vocab_parallel=False``, replicated: every rank computes all the logits
from the replicated final norm, so the program needs no collective besides the all-reduces,
which is what ranks sharing a GPU need; jax_fusedar/cli/shared_demo.py). Layers run unrolled
(a Python loop) or under ``lax.scan`` over stacked weights (MaxText's default).

Each layer is written pre-norm as in Hugging Face's ``LlamaDecoderLayer``, with one choice of
where a norm sits: the norm that follows a layer's second all-reduce (the next layer's input
norm, or the final norm) is computed at the end of that layer rather than at the start of the
next. Under ``lax.scan`` that keeps each all-reduce, its residual add and the RMSNorm that
reads the sum in one scan step, where a jaxpr-level pass can see them together (with the norm
at the top of the next step the pair straddles two iterations). Same math either way.

Weights are held the way serving stacks hold them (vLLM's QKVParallelLinear and
MergedColumnParallelLinear, MaxText's fused_qkv / fused MLP): one q|k|v projection and one
gate|up projection per layer, each rank's columns contiguous, so a decode step runs four
matmuls per layer instead of seven. ``init_params`` gives every layer's weights stacked on a
leading axis (what ``lax.scan`` slices); ``arrange(params, scan=False)`` gives one array per
layer for unrolled layers, so no step slices a stacked weight. Both matter at batch 1 on
GPUs, where XLA's small-M matmuls are cheap but its slices of stacked weights are copies:
on 2 x H200 at Llama-3-8B shapes, slicing stacked weights in the unrolled program cost 4.3 of
its 11.1 ms of kernels per step, and seven separate projections 134 us per layer against
85 us for the fused four (device-clock profiles, docs/decisions.md). Under ``lax.scan`` XLA
still copies each layer's weights out of the stack every step (2.9 ms at batch 1): a cost of
scanning, not of the model, and the reason serving stacks unroll decode. The KV caches
stay one stacked array per rank in both modes, written in place (``layer``).
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
                raise ValueError(
                    f"{name} {getattr(self, name)} does not split over {world} "
                    f"tensor-parallel ranks"
                )


# Llama-3-8B's shapes (rope scaling left out: it only changes the frequencies).
LLAMA3_8B = LlamaConfig(
    vocab=128256,
    hidden=4096,
    ffn=14336,
    layers=32,
    heads=32,
    kv_heads=8,
    rope_theta=500000.0,
    rms_eps=1e-5,
)
# A small one for CPUs: 8 ranks, 2 query heads and 1 KV head each.
TINY = LlamaConfig(
    vocab=512, hidden=256, ffn=512, layers=2, heads=16, kv_heads=8, rope_theta=10000.0, rms_eps=1e-5
)
PRESETS = {"llama3-8b": LLAMA3_8B, "tiny": TINY}


def _layer_specs(axis: str, stacked: bool) -> dict:
    lead = (None,) if stacked else ()
    col, row = P(*lead, None, axis), P(*lead, axis, None)
    return {
        "attn_norm": P(),
        "mlp_norm": P(),
        "wqkv": col,
        "wo": row,
        "w_gate_up": col,
        "w_down": row,
    }


def param_specs(
    axis: str, *, stacked: bool = True, layers: int | None = None, vocab_parallel: bool = True
) -> dict:
    """PartitionSpecs of the global weights: layer weights stacked on a leading axis
    (``stacked``), else a list of ``layers`` per-layer dicts (see ``arrange``); the LM head
    split over the vocabulary or replicated (``vocab_parallel``)."""
    top = {"embed": P(), "final_norm": P(), "lm_head": P(None, axis) if vocab_parallel else P()}
    if stacked:
        return {**top, "layers": _layer_specs(axis, True)}
    return {**top, "layers": [_layer_specs(axis, False) for _ in range(layers)]}


def specs_like(params: dict, axis: str, *, vocab_parallel: bool = True) -> dict:
    """The PartitionSpecs of a params tree in either layout."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return param_specs(axis, stacked=False, layers=len(layers), vocab_parallel=vocab_parallel)
    return param_specs(axis, vocab_parallel=vocab_parallel)


def param_shapes(cfg: LlamaConfig) -> dict:
    """Global shapes, stacked layout. wqkv's columns are q | k | v of rank 0, then of rank 1,
    ...; w_gate_up's are gate | up of each rank in turn (``pack_columns``)."""
    L, H, F, hd = cfg.layers, cfg.hidden, cfg.ffn, cfg.head_dim
    return {
        "embed": (cfg.vocab, H),
        "final_norm": (H,),
        "lm_head": (H, cfg.vocab),
        "layers": {
            "attn_norm": (L, H),
            "mlp_norm": (L, H),
            "wqkv": (L, H, (cfg.heads + 2 * cfg.kv_heads) * hd),
            "wo": (L, cfg.heads * hd, H),
            "w_gate_up": (L, H, 2 * F),
            "w_down": (L, F, H),
        },
    }


# The separate projections of Hugging Face's LlamaForCausalLM (what init_params_numpy draws).
HF_SHAPES = {
    "wq": lambda c: (c.layers, c.hidden, c.heads * c.head_dim),
    "wk": lambda c: (c.layers, c.hidden, c.kv_heads * c.head_dim),
    "wv": lambda c: (c.layers, c.hidden, c.kv_heads * c.head_dim),
    "wo": lambda c: (c.layers, c.heads * c.head_dim, c.hidden),
    "w_gate": lambda c: (c.layers, c.hidden, c.ffn),
    "w_up": lambda c: (c.layers, c.hidden, c.ffn),
    "w_down": lambda c: (c.layers, c.ffn, c.hidden),
    "embed": lambda c: (c.vocab, c.hidden),
    "final_norm": lambda c: (c.hidden,),
    "lm_head": lambda c: (c.hidden, c.vocab),
    "attn_norm": lambda c: (c.layers, c.hidden),
    "mlp_norm": lambda c: (c.layers, c.hidden),
}


def pack_columns(parts, tp: int):
    """Column-parallel weights [..., K, N_i] -> one [..., K, sum N_i] whose columns are, for
    rank 0 then rank 1 ..., that rank's slice of each part in order: split by columns over
    ``tp`` ranks, every rank gets its own q|k|v (or gate|up) side by side."""
    xp = np if all(isinstance(p, np.ndarray) for p in parts) else jnp
    blocks = [xp.reshape(p, (*p.shape[:-1], tp, p.shape[-1] // tp)) for p in parts]
    out = xp.concatenate(blocks, axis=-1)
    return xp.reshape(out, (*out.shape[:-2], -1))


# The column-parallel weights packed per rank (``pack_columns``): name -> widths of its parts.
PACKED = {
    "wqkv": lambda c: (c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim),
    "w_gate_up": lambda c: (c.ffn, c.ffn),
}


def unpack_columns(w, widths, tp: int):
    """The inverse of ``pack_columns``: [..., K, sum(widths)] packed for ``tp`` ranks -> the
    parts [..., K, widths[i]]."""
    xp = np if isinstance(w, np.ndarray) else jnp
    per_rank = [width // tp for width in widths]
    blocks = xp.reshape(w, (*w.shape[:-1], tp, sum(per_rank)))
    bounds = np.cumsum([0, *per_rank])
    return [
        xp.reshape(blocks[..., a:b], (*w.shape[:-1], -1)) for a, b in zip(bounds[:-1], bounds[1:])
    ]


def repack_columns(params: dict, cfg, from_tp: int, to_tp: int) -> dict:
    """The same model's weights (stacked layout) packed for ``to_tp`` ranks instead of
    ``from_tp``: only the columns of wqkv and w_gate_up move (``init_params`` on the devices
    draws the packed arrays themselves, so the layout a draw is read with decides the model)."""
    layers = dict(params["layers"])
    for name, widths in PACKED.items():
        if name in layers:
            layers[name] = pack_columns(unpack_columns(layers[name], widths(cfg), from_tp), to_tp)
    return {**params, "layers": layers}


def _fan_in(name, shape):
    return shape[-2] if name not in ("embed",) else 1


def init_params_numpy(cfg: LlamaConfig, seed: int) -> dict:
    """float32 numpy weights with Hugging Face's separate projections (``HF_SHAPES``):
    normal / sqrt(fan-in) (activations stay O(1) through the layers), norm gains
    1 + 0.1 * normal (random, so a gain used at the wrong place shows)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape_of in HF_SHAPES.items():
        shape = shape_of(cfg)
        if name.endswith("norm"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            scale = 1.0 / math.sqrt(_fan_in(name, shape))
            out[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return out


def from_hf_layout(w: dict, tp: int) -> dict:
    """Separate projections (``init_params_numpy``) -> this model's stacked tree for ``tp``
    tensor-parallel ranks."""
    return {
        "embed": w["embed"],
        "final_norm": w["final_norm"],
        "lm_head": w["lm_head"],
        "layers": {
            "attn_norm": w["attn_norm"],
            "mlp_norm": w["mlp_norm"],
            "wqkv": pack_columns([w["wq"], w["wk"], w["wv"]], tp),
            "wo": w["wo"],
            "w_gate_up": pack_columns([w["w_gate"], w["w_up"]], tp),
            "w_down": w["w_down"],
        },
    }


def place(value, sharding):
    """A host array (the same in every process) as a global array of ``sharding``, each
    process filling its own shards. Unlike jax.device_put, it runs no cross-process check
    (a collective, which ranks sharing a GPU cannot run: XLA's NCCL refuses them)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def init_params(
    cfg: LlamaConfig,
    mesh,
    axis: str,
    dtype,
    seed: int,
    *,
    host: bool = True,
    vocab_parallel: bool = True,
):
    """Weights as sharded arrays of ``dtype``, stacked layout. ``host``: drawn with numpy
    (reproducible across machines, used by the Hugging Face parity check); else drawn on the
    devices with jax.random directly into their shards (Llama-3-8B's 8 G values in
    seconds; the values do not depend on the sharding, but wqkv and w_gate_up are read as
    packed for the mesh's TP size: ``repack_columns`` gives the same model for another)."""
    specs = param_specs(axis, vocab_parallel=vocab_parallel)
    tp = mesh.shape[axis]
    if host:
        tree = from_hf_layout(init_params_numpy(cfg, seed), tp)
        np_dtype = jnp.dtype(dtype)
        return jax.tree.map(
            lambda v, s: place(np.asarray(v).astype(np_dtype), NamedSharding(mesh, s)), tree, specs
        )
    shapes = param_shapes(cfg)
    flat_shapes, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    names = [
        jax.tree_util.keystr(k)
        for k, _ in jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda x: isinstance(x, tuple)
        )[0]
    ]
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

    @partial(jax.jit, out_shardings=shardings)
    def draw(key):
        keys = jax.random.split(key, len(flat_shapes))
        out = []
        for k, name, shape in zip(keys, names, flat_shapes):
            z = jax.random.normal(k, shape, jnp.float32)
            if name.endswith("norm']"):
                out.append((1.0 + 0.1 * z).astype(dtype))
            else:
                fan_in = 1 if "embed" in name else shape[-2]
                out.append((z / math.sqrt(fan_in)).astype(dtype))
        return jax.tree.unflatten(treedef, out)

    return draw(jax.random.key(seed))


def arrange(params: dict, mesh, axis: str, *, scan: bool, vocab_parallel: bool = True) -> dict:
    """The weights in the layout a layer mode reads without copying: stacked for ``scan``,
    one array per layer for unrolled layers (sliced once here, a copy of the layer weights;
    under jit every step would slice, i.e. copy, them again)."""
    layers = params["layers"]
    if scan or isinstance(layers, (list, tuple)):
        if scan and isinstance(layers, (list, tuple)):
            raise ValueError("arrange(scan=True) takes stacked weights (init_params's layout)")
        return params
    n = next(iter(layers.values())).shape[0]
    specs = param_specs(axis, stacked=False, layers=n, vocab_parallel=vocab_parallel)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    split = jax.jit(
        lambda p: {
            **{k: v for k, v in p.items() if k != "layers"},
            "layers": [{k: v[i] for k, v in p["layers"].items()} for i in range(n)],
        },
        out_shardings=shardings,
    )
    return split(params)


def cache_shape(cfg: LlamaConfig, batch: int, length: int) -> tuple:
    return (cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim)


def cache_spec(axis: str):
    return P(None, None, None, axis, None)


def init_cache(cfg, mesh, axis, dtype, batch: int, length: int):
    """Zeroed (k, v) caches, [layers, batch, length, kv_heads, head_dim], split over KV heads."""
    sharding = NamedSharding(mesh, cache_spec(axis))
    make = jax.jit(
        lambda: jnp.zeros(cache_shape(cfg, batch, length), dtype), out_shardings=sharding
    )
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


def rope_tables(positions, hd: int, theta):
    """cos, sin [B, T, 1, hd] of the rotate-half rotary embedding at ``positions`` [B, T];
    computed once per forward pass and shared by every layer (as Hugging Face's LlamaModel
    does), not once per layer."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, hd/2]
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1)[:, :, None, :]
    return cos, sin


def rope(x, tables):
    """Rotary embedding, rotate-half form (Hugging Face Llama): x [B, T, heads, hd]."""
    cos, sin = tables
    hd = x.shape[-1]
    x32 = x.astype(jnp.float32)
    rot = jnp.concatenate([-x32[..., hd // 2 :], x32[..., : hd // 2]], -1)
    return (x32 * cos + rot * sin).astype(x.dtype)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def layer(cfg, axis, norm, x, h, lp, ck_all, cv_all, i, pos, tables, mlp=None):
    """One decoder layer on one rank. x: the residual stream, h: its normed copy [B, T, H];
    lp: this layer's weight shards; ck_all, cv_all: every layer's cache shard
    [L, B, S, kv_local, hd], of which this is layer ``i``; pos: the first position of the T
    tokens; tables: rope_tables(). Returns (x, h, ck_all, cv_all) with h already the next
    norm's output (see the module docstring). Only the T new rows of the cache are written,
    in place in the whole cache (a donated cache is never copied; slicing one layer out and
    stacking the layers back would copy every layer's cache every step)."""
    B, T, _ = x.shape
    hd = cfg.head_dim
    qkv = _dot(h, lp["wqkv"])  # [B, T, (q + 2 kv) local heads * hd]
    kv_width = ck_all.shape[3] * hd
    q_width = qkv.shape[-1] - 2 * kv_width
    q = qkv[..., :q_width].reshape(B, T, -1, hd)
    k = qkv[..., q_width : q_width + kv_width].reshape(B, T, -1, hd)
    v = qkv[..., q_width + kv_width :].reshape(B, T, -1, hd)
    q, k = rope(q, tables), rope(k, tables)
    ck_all = jax.lax.dynamic_update_slice(ck_all, k.astype(ck_all.dtype)[None], (i, 0, pos, 0, 0))
    cv_all = jax.lax.dynamic_update_slice(cv_all, v.astype(cv_all.dtype)[None], (i, 0, pos, 0, 0))
    ck = jax.lax.dynamic_index_in_dim(ck_all, i, keepdims=False)
    cv = jax.lax.dynamic_index_in_dim(cv_all, i, keepdims=False)
    kvl = ck.shape[2]
    group = q.shape[2] // kvl
    qg = q.reshape(B, T, kvl, group, hd)
    # float32 products and sums without a float32 copy of the cache.
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", qg, ck, preferred_element_type=jnp.float32
    ) / math.sqrt(hd)
    S = ck.shape[1]
    visible = jnp.arange(S)[None, :] <= (pos + jnp.arange(T))[:, None]  # causal, [T, S]
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("bkgts,bskd->btkgd", probs, cv.astype(jnp.float32))
    attn = attn.reshape(B, T, -1).astype(x.dtype)
    x = jax.lax.psum(_dot(attn, lp["wo"]), axis) + x  # row-parallel
    h = norm(x, lp["mlp_norm"], cfg.rms_eps)
    x, h = (dense_mlp if mlp is None else mlp)(cfg, axis, norm, x, h, lp)
    return x, h, ck_all, cv_all


def dense_mlp(cfg, axis, norm, x, h, lp):
    """The SwiGLU MLP on this rank's FFN slice, then its all-reduce, the residual add and the
    norm that ends the layer: returns (x, h). ``layer``'s ``mlp`` swaps it (an MoE block:
    jax_fusedar/models/moe_llama.py)."""
    gate, up = jnp.split(_dot(h, lp["w_gate_up"]), 2, axis=-1)  # this rank's FFN slice
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype)
    mlp = _dot(act * up, lp["w_down"])
    x = jax.lax.psum(mlp, axis) + x  # row-parallel
    return x, norm(x, lp["next_norm"], cfg.rms_eps)


def forward_local(cfg, axis, params, tokens, ck, cv, pos, *, scan: bool, norm=rms_norm, mlp=None):
    """The per-rank forward pass: tokens [B, T] int32 at positions pos..pos+T-1. Returns
    (this rank's vocabulary slice of the logits [B, T, V/tp] float32, caches)."""
    layers = params["layers"]
    per_layer = isinstance(layers, (list, tuple))
    if scan and per_layer:
        raise ValueError("scanned layers take stacked weights (llama.arrange(..., scan=True))")
    gains = [lp["attn_norm"] for lp in layers] if per_layer else None
    B, T = tokens.shape
    tables = rope_tables(
        pos + jnp.arange(T, dtype=jnp.int32)[None, :].repeat(B, 0), cfg.head_dim, cfg.rope_theta
    )
    x = jnp.take(params["embed"], tokens, axis=0)
    h = norm(x, gains[0] if per_layer else layers["attn_norm"][0], cfg.rms_eps)
    if scan:
        # The gain of the norm each layer ends with: the next layer's input norm, then the final.
        stacked = dict(
            layers, next_norm=jnp.concatenate([layers["attn_norm"][1:], params["final_norm"][None]])
        )

        # The caches ride in the carry (updated in place), not as scanned inputs/outputs
        # (which would restack, i.e. copy, all of them every step).
        def step(carry, xs):
            x, h, ck, cv = carry
            lp, i = xs
            return layer(cfg, axis, norm, x, h, lp, ck, cv, i, pos, tables, mlp), None

        n = layers["attn_norm"].shape[0]
        (x, h, ck, cv), _ = jax.lax.scan(
            step, (x, h, ck, cv), (stacked, jnp.arange(n, dtype=jnp.int32))
        )
    else:
        n = len(layers) if per_layer else layers["attn_norm"].shape[0]
        for i in range(n):
            # Stacked weights work here too, but each slice is a copy per step: see arrange().
            lp = dict(layers[i]) if per_layer else {k: v[i] for k, v in layers.items()}
            lp["next_norm"] = (
                params["final_norm"]
                if i == n - 1
                else gains[i + 1]
                if per_layer
                else layers["attn_norm"][i + 1]
            )
            x, h, ck, cv = layer(cfg, axis, norm, x, h, lp, ck, cv, i, pos, tables, mlp)
    logits = jnp.einsum("bth,hv->btv", h, params["lm_head"], preferred_element_type=jnp.float32)
    return logits, ck, cv


def make_forward(cfg, mesh, axis, *, scan: bool, norm=rms_norm, vocab_parallel: bool = True):
    """forward(params, tokens, ck, cv, pos) -> (logits [B, T, V] float32, ck, cv): the
    shard_map over ``axis`` (not jitted: wrap it in jax.jit, or in jax_fusedar.fuse). params
    in either layout (``arrange``); the specs follow the tree it is called with. The logits
    are split over the vocabulary, or replicated with a replicated LM head
    (``vocab_parallel=False``, see ``init_params``)."""
    body = partial(forward_local, cfg, axis, scan=scan, norm=norm)
    logits_spec = P(None, None, axis) if vocab_parallel else P()

    def forward(params, tokens, ck, cv, pos):
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(
                specs_like(params, axis, vocab_parallel=vocab_parallel),
                P(),
                cache_spec(axis),
                cache_spec(axis),
                P(),
            ),
            out_specs=(logits_spec, cache_spec(axis), cache_spec(axis)),
        )(params, tokens, ck, cv, pos)

    return forward


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
