"""The Llama decoder of ``llama.py`` with mixture-of-experts MLPs, in plain JAX under
``jax.shard_map``, and the same model through jax_fusedar's MoE finalize op.

Each layer's MLP is a routed MoE block plus a shared expert (DeepSeek/Qwen-MoE style):

* router: ``h @ router`` (float32 logits, replicated weights), top-k experts per token,
  softmax over the k logits as the token's expert weights;
* experts, expert-parallel over the mesh axis: rank r holds experts r*E/W .. (r+1)*E/W - 1
  (SwiGLU each) and computes them for every token (dense dispatch: simple and static-shaped;
  the tokens a rank's experts do not serve are simply not gathered). Their outputs, stacked
  [local experts * tokens, H], are the "permuted rows" of FlashInfer's finalize pattern, with
  ``idx[t, k] = local expert * tokens + t`` when the k-th expert of token t is local, else -1;
* shared expert: a SwiGLU MLP split Megatron-style over the axis (columns, then rows): each
  rank holds a partial sum.

Written plainly (``fused=False``): per rank, the weighted sum of the token's local expert rows
plus the shared expert's partial sum, ``psum`` over the axis, the residual add and the next
RMSNorm. Fused: ``jax_fusedar.moe_finalize_allreduce_fusion`` does all of that in one kernel
(pattern 7). The two differ only in rounding (the kernel rounds after every addition, the
plain form sums in float32), so greedy tokens agree unless two logits are within that.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import llama


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    base: llama.LlamaConfig  # attention, vocabulary, norms (its ffn is unused)
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int

    def check(self, world: int) -> None:
        self.base.check(world)
        if self.experts % world:
            raise ValueError(f"experts {self.experts} do not split over {world} ranks")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} is not in 1..{self.experts}")
        if self.shared_ffn % world:
            raise ValueError(f"shared_ffn {self.shared_ffn} does not split over {world} ranks")


TINY = MoeConfig(
    dataclasses.replace(llama.TINY, ffn=256), experts=16, top_k=4, expert_ffn=128, shared_ffn=256
)
# GPU demo: hidden 2048 (a multiple of 256, as the MoE kernels need), 64 experts, top-8.
SMALL = MoeConfig(
    llama.LlamaConfig(
        vocab=32000,
        hidden=2048,
        ffn=2048,
        layers=8,
        heads=16,
        kv_heads=8,
        rope_theta=500000.0,
        rms_eps=1e-5,
    ),
    experts=64,
    top_k=8,
    expert_ffn=512,
    shared_ffn=1024,
)
PRESETS = {"tiny": TINY, "small": SMALL}


def param_specs(axis: str, *, vocab_parallel: bool = True) -> dict:
    specs = llama.param_specs(axis, vocab_parallel=vocab_parallel)
    layers = {k: v for k, v in specs["layers"].items() if k not in ("w_gate_up", "w_down")}
    layers.update(
        router=P(),
        expert_gate_up=P(None, axis, None, None),
        expert_down=P(None, axis, None, None),
        shared_gate=P(None, None, axis),
        shared_up=P(None, None, axis),
        shared_down=P(None, axis, None),
    )
    return {**specs, "layers": layers}


def init_params(
    cfg: MoeConfig, mesh, axis: str, dtype, seed: int, *, vocab_parallel: bool = True
) -> dict:
    """Random weights (normal / sqrt(fan-in)), numpy-drawn, placed as ``param_specs``: the
    same model for every TP size."""
    w = llama.init_params_numpy(cfg.base, seed)
    tp = mesh.shape[axis]
    tree = llama.from_hf_layout(w, tp)
    del tree["layers"]["w_gate_up"], tree["layers"]["w_down"]
    rng = np.random.default_rng(seed + 1)
    L, H, E, F, S = (cfg.base.layers, cfg.base.hidden, cfg.experts, cfg.expert_ffn, cfg.shared_ffn)

    def draw(shape, fan_in):
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

    tree["layers"].update(
        router=draw((L, H, E), H),
        expert_gate_up=draw((L, E, H, 2 * F), H),
        expert_down=draw((L, E, F, H), F),
        shared_gate=draw((L, H, S), H),
        shared_up=draw((L, H, S), H),
        shared_down=draw((L, S, H), S),
    )
    np_dtype = jnp.dtype(dtype)
    return jax.tree.map(
        lambda v, s: llama.place(np.asarray(v).astype(np_dtype), NamedSharding(mesh, s)),
        tree,
        param_specs(axis, vocab_parallel=vocab_parallel),
    )


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def moe_block(cfg: MoeConfig, axis, h, lp):
    """(permuted rows [El * N, H], idx int32 [N, k], weights [N, k] in h's dtype, shared
    expert partial sum [N, H]) of this rank for the N = B * T tokens of ``h``."""
    B, T, H = h.shape
    n = B * T
    hf = h.reshape(n, H)
    logits = jnp.dot(hf, lp["router"], preferred_element_type=jnp.float32)  # [N, E]
    top_logits, top_experts = jax.lax.top_k(logits, cfg.top_k)
    weights = jax.nn.softmax(top_logits, axis=-1).astype(h.dtype)
    local_experts = lp["expert_gate_up"].shape[0]
    first = jax.lax.axis_index(axis) * local_experts
    gate_up = jnp.einsum(
        "nh,ehf->enf", hf, lp["expert_gate_up"], preferred_element_type=jnp.float32
    ).astype(h.dtype)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(h.dtype) * up
    rows = jnp.einsum(
        "enf,efh->enh", act, lp["expert_down"], preferred_element_type=jnp.float32
    ).astype(h.dtype)
    local = top_experts - first
    mine = (local >= 0) & (local < local_experts)
    idx = jnp.where(mine, local * n + jnp.arange(n)[:, None], -1).astype(jnp.int32)
    s_act = jax.nn.silu(_dot(hf, lp["shared_gate"]).astype(jnp.float32)).astype(h.dtype)
    shared = _dot(s_act * _dot(hf, lp["shared_up"]), lp["shared_down"])
    return rows.reshape(local_experts * n, H), idx, weights, shared


def term_magnitudes(cfg: MoeConfig, axis, h, lp, shared_blocks: int = 1):
    """Per token row [N, H] float32: this rank's sum of the magnitudes of the terms the MoE
    finalize kernel adds, ``sum_k |w_k * row_k|`` over its local experts plus ``|shared|``
    (``jax_fusedar/ops/moe_reference.py`` lists its rounding points). Summed over the ranks of a
    TP group it bounds every value the kernel rounds before the residual add. With
    ``shared_blocks`` > 1 the shared expert's partial sum is split into that many column
    blocks, each counted on its own: what the ranks of a TP group ``shared_blocks`` times
    larger than this mesh axis hold (an unsharded model counted as its TP group)."""
    rows, idx, weights, _ = moe_block(cfg, axis, h, lp)
    valid = idx >= 0
    gathered = jnp.take(rows, jnp.where(valid, idx, 0), axis=0).astype(jnp.float32)
    w = jnp.where(valid, weights.astype(jnp.float32), 0.0)[..., None]
    routed = jnp.abs(gathered * w).sum(1)
    hf = h.reshape(-1, h.shape[-1])
    s_act = jax.nn.silu(_dot(hf, lp["shared_gate"]).astype(jnp.float32)).astype(h.dtype)
    s_act = s_act * _dot(hf, lp["shared_up"])
    down = lp["shared_down"]
    cols = s_act.shape[-1] // shared_blocks
    shared = sum(
        jnp.abs(
            _dot(s_act[:, b * cols : (b + 1) * cols], down[b * cols : (b + 1) * cols]).astype(
                jnp.float32
            )
        )
        for b in range(shared_blocks)
    )
    return routed + shared


def plain_moe_mlp(cfg: MoeConfig):
    """The MoE MLP as a model would write it: combine, psum, residual add, RMSNorm."""

    def mlp(_, axis, norm, x, h, lp):
        rows, idx, weights, shared = moe_block(cfg, axis, h, lp)
        valid = idx >= 0
        gathered = jnp.take(rows, jnp.where(valid, idx, 0), axis=0).astype(jnp.float32)
        w = jnp.where(valid, weights.astype(jnp.float32), 0.0)[..., None]
        combined = ((gathered * w).sum(1) + shared.astype(jnp.float32)).astype(x.dtype)
        x = jax.lax.psum(combined.reshape(x.shape), axis) + x
        return x, norm(x, lp["next_norm"], cfg.base.rms_eps)

    return mlp


def term_ratios(cfg: MoeConfig, mesh, axis, params, tokens, ck, cv, *, tp: int) -> list:
    """One forward pass of the plain model over ``tokens`` from position 0: per layer, the
    largest sum over the TP group's ranks of ``term_magnitudes`` (``tp`` ranks, on this mesh
    or counted on fewer devices) over the largest magnitude of the residual stream after the
    block. Returns the layers' ratios in no particular order (jax.debug.callback)."""
    seen = []
    plain = plain_moe_mlp(cfg)
    blocks = tp // mesh.shape[axis]

    def record(ratio, index):
        if int(index) == 0:  # every device computes the same (replicated) ratio
            seen.append(float(ratio))

    def mlp(c, ax, norm, x, h, lp):
        mag = jax.lax.psum(term_magnitudes(cfg, ax, h, lp, blocks), ax)
        x, h = plain(c, ax, norm, x, h, lp)
        ratio = jnp.max(mag) / jnp.max(jnp.abs(x.astype(jnp.float32)))
        jax.debug.callback(record, ratio, jax.lax.axis_index(ax))
        return x, h

    logits, *_ = jax.jit(make_forward(cfg, mesh, axis, mlp=mlp))(
        params, tokens, ck, cv, jnp.int32(0)
    )
    jax.block_until_ready(logits)
    jax.effects_barrier()
    return seen


def fused_moe_mlp(cfg: MoeConfig, workspace):
    """The same block through ``jax_fusedar.moe_finalize_allreduce_fusion``."""
    from jax_fusedar.ops.moe import moe_finalize_allreduce_fusion

    def mlp(_, axis, norm, x, h, lp):
        rows, idx, weights, shared = moe_block(cfg, axis, h, lp)
        out = moe_finalize_allreduce_fusion(
            rows,
            idx,
            axis_name=axis,
            workspace=workspace,
            residual=x.reshape(idx.shape[0], -1),
            rms_gamma=lp["next_norm"],
            expert_scale_factor=weights,
            shared_expert_output=shared,
            rms_eps=cfg.base.rms_eps,
        )
        return out.residual_out.reshape(x.shape), out.norm_out.reshape(x.shape)

    return mlp


def make_forward(
    cfg: MoeConfig, mesh, axis, *, mlp, scan: bool = True, vocab_parallel: bool = True
):
    """forward(params, tokens, ck, cv, pos) -> (logits [B, T, V] float32, ck, cv); the
    logits split over the vocabulary or replicated (llama.make_forward)."""
    body = partial(llama.forward_local, cfg.base, axis, scan=scan, mlp=mlp)
    logits_spec = P(None, None, axis) if vocab_parallel else P()

    def forward(params, tokens, ck, cv, pos):
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(
                param_specs(axis, vocab_parallel=vocab_parallel),
                P(),
                llama.cache_spec(axis),
                llama.cache_spec(axis),
                P(),
            ),
            out_specs=(logits_spec, llama.cache_spec(axis), llama.cache_spec(axis)),
        )(params, tokens, ck, cv, pos)

    return forward
