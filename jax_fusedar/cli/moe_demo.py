"""``python -m jax_fusedar demo --moe``: the Llama decoder with MoE MLPs
(jax_fusedar/models/moe_llama.py), written plainly and with jax_fusedar's MoE finalize op
(pattern 7: expert combine + all-reduce + residual add + RMSNorm in one kernel on GPUs, the
reference lowering on CPUs). Prints both models' greedy tokens, the largest logits difference
and decode speed; PASS when the tokens agree (or diverge only at a near tie) and the logits
differ within the rounding tolerance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .compare import (
    MOE_SITE_FORMULA,
    compare_greedy,
    median_seconds,
    moe_kernel_roundings,
    moe_tolerance,
    near_tie,
)
from .demo import CPU_TIMINGS, progress
from .setup import AXIS, SetupError, describe_devices, moe_preset, open_workspace, tp_mesh


def main(args) -> int:
    from ..models import llama, moe_llama

    mesh = tp_mesh(args.tp)
    world = mesh.shape[AXIS]
    on_gpu = jax.devices()[0].platform == "gpu"
    if args.bench:
        raise SetupError("--moe has no --bench mode (tests/gpu/workers/moe_gpu.py times the op)")
    name, cfg = moe_preset(args, world, on_gpu)
    dtype = jnp.dtype(args.dtype)
    base = cfg.base
    params = moe_llama.init_params(cfg, mesh, AXIS, dtype, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompt = jnp.asarray(rng.integers(0, base.vocab, (args.batch, args.prompt)), jnp.int32)
    length = args.prompt + args.steps
    print(
        f"jax_fusedar demo --moe: Llama decoder with MoE MLPs ({name}: {base.layers} layers, "
        f"hidden {base.hidden}, {cfg.experts} experts top-{cfg.top_k} (expert ffn "
        f"{cfg.expert_ffn}) + a shared expert (ffn {cfg.shared_ffn}), {base.heads}/"
        f"{base.kv_heads} heads, vocab {base.vocab}), {args.dtype}, random weights (seed "
        f"{args.seed}), experts parallel over {world} devices; batch {args.batch}, prompt "
        f"{args.prompt}, {args.steps} greedy steps"
    )
    with open_workspace(
        mesh,
        max_token_num=args.batch * args.prompt,
        hidden_dim=base.hidden,
        dtype=dtype,
        backend=args.backend,
    ) as ws:
        print(describe_devices(world, ws.backend))
        progs = {
            "plain": jax.jit(
                moe_llama.make_forward(cfg, mesh, AXIS, mlp=moe_llama.plain_moe_mlp(cfg))
            ),
            "fused": jax.jit(
                moe_llama.make_forward(cfg, mesh, AXIS, mlp=moe_llama.fused_moe_mlp(cfg, ws))
            ),
        }
        cache = llama.init_cache(base, mesh, AXIS, dtype, args.batch, length)
        tok1, pos_d = prompt[:, :1], jnp.int32(args.prompt)
        outs, speed = {}, {}
        for label, prog in progs.items():
            with progress(f"compiling the {label} prefill and decode programs"):
                pre = prog.lower(params, prompt, *cache, jnp.int32(0)).compile()
                dec = prog.lower(params, tok1, *cache, pos_d).compile()
            with progress(f"running the {label} programs: {args.steps} greedy steps, timing"):
                outs[label] = llama.greedy_decode(pre, dec, params, prompt, *cache, args.steps)
                speed[label] = args.batch / median_seconds(
                    dec, (params, tok1, *cache, pos_d), args.iters
                )
            del pre, dec
        text = progs["fused"].lower(params, tok1, *cache, pos_d).as_text()
        kernel_calls = text.count("jax_fusedar_moe_allreduce_fusion_v1")
        # The two programs differ at the MoE blocks only (the attention's psum is the same):
        # each a site scaled by the magnitudes that flow through it (measured on the plain
        # model over the prompt), whose terms the kernel rounds moe_kernel_roundings times
        # and the plain program 2 * world - 1 times (each rank's float32 sum, then its psum).
        ratios = moe_llama.term_ratios(
            cfg,
            mesh,
            AXIS,
            params,
            prompt,
            *llama.init_cache(base, mesh, AXIS, dtype, args.batch, args.prompt),
            tp=world,
        )
    first, err, scale, margins = compare_greedy(*outs["plain"], *outs["fused"])
    n = moe_kernel_roundings(cfg.top_k, world) + 2 * world - 1
    tol = moe_tolerance(args.dtype, ratios, n)
    rel = err / scale if scale else float("inf")
    print(
        f"MoE combine sites through the fused op: {base.layers} per step (kernel custom calls "
        f"in the compiled decode step: {kernel_calls})"
    )
    if on_gpu:  # one GPU per rank: a measurement of the programs
        print(
            f"decode tok/s: plain {speed['plain']:.1f}, fused {speed['fused']:.1f} (speedup "
            f"{speed['fused'] / speed['plain']:.3f})"
        )
    else:
        print(CPU_TIMINGS)
        print(f"decode tok/s: plain {speed['plain']:.1f}, fused {speed['fused']:.1f}")
    print(f"greedy tokens, sequence 0, plain: {outs['plain'][0][0].tolist()}")
    print(f"greedy tokens, sequence 0, fused: {outs['fused'][0][0].tolist()}")
    if first is None:
        print(f"greedy tokens: identical over {args.steps} steps x {args.batch} sequences")
    else:
        print(
            f"greedy tokens: first divergence at step {first[0]}, sequence {first[1]} ({margins})"
        )
    print(
        f"max logits error {err:.4g} (relative {rel:.3e}; tolerance {tol:.3e} = eps + sum "
        f"over layers of ({MOE_SITE_FORMULA}) with n = {n}, m = "
        f"{' '.join(f'{m:.3g}' for m in sorted(ratios))})"
    )
    ok = rel <= tol and (first is None or near_tie(outs["plain"][1], first, err))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
