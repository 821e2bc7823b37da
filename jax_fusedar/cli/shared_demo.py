"""One rank of the demo run as one process per rank (jax_fusedar/cli/ranks.py), for the
dense Llama and ``--moe``.

Each rank process holds one device of the TP group (on a one-GPU machine they share it). XLA's
NCCL refuses two ranks on one GPU, so the program the ranks run has no collective but the fused
kernel: every psum + residual add + RMSNorm is fused by ``jax_fusedar.fuse`` (the run stops
with a SetupError where one is not), the MoE combine is the MoE finalize
op, and the LM head is replicated (``vocab_parallel=False``) so that every rank computes all
the logits from the replicated final norm instead of gathering them. The unfused TP program
is not run (its psum is XLA's all-reduce): the reference is the same model unsharded, on one
device of rank 0, which needs no collective. The two programs differ in rounding only: at
every all-reduce the TP program rounds each rank's partial sum before the sum (the
reference's single matmul rounds once), which ``reference_tolerance`` bounds. Compiled
programs are started together (a store barrier after compiling), so that no rank waits in
the kernel while another still compiles.

Rank 0 prints the report; every rank returns its greedy tokens, which the launcher compares.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .compare import MOE_SITE_FORMULA, compare_greedy, moe_kernel_roundings, moe_tolerance, near_tie
from .demo import progress
from .demo_args import LAYER_MODES
from .ranks import Plan, shared_gpu_timing
from .setup import (
    AXIS,
    SetupError,
    describe_devices,
    llama_preset,
    moe_preset,
    open_workspace,
    require_fuse_jax,
)

# Ranks sharing a GPU take turns on it, so a deep model only makes the check slower: the
# preset's layers are cut to this many there unless --layers says otherwise.
SHARED_GPU_LAYERS = 4
BARRIER_TIMEOUT_S = 1800.0  # ranks wait this long for each other between phases
REFERENCE_TOLERANCE_FORMULA = "eps + sites * (eps + sqrt(world) * eps / 2)"
MOE_REFERENCE_TOLERANCE_FORMULA = (
    f"eps + layers * (eps + sqrt(world) * eps / 2) + sum over layers of ({MOE_SITE_FORMULA})"
)


def reference_tolerance(dtype: str, world: int, sites: int) -> float:
    """Bound on max|fused - reference| / max|reference| of the logits, the reference being
    the same model on one device.

    At each all-reduce the TP program rounds each of its ``world`` partial sums to the model
    dtype before summing them (about sqrt(world) * eps / 2 together), where the reference's
    single matmul rounds once, and the residual add rounds that differing sum, which can
    land one ulp (eps) apart. As in the demos' own tolerance (cli/compare.py), the residual
    stream carries every site's difference forward and the final norm maps it to the
    logits, plus one rounding of the norm output."""
    eps = float(jnp.finfo(dtype).eps)
    return eps + sites * (eps + math.sqrt(world) * eps / 2)


def _phase(rank: int, what: str):
    """Rank 0's line of progress for a phase (cli/demo.py's ``progress``); the other ranks
    keep their logs to errors."""
    return progress(what) if rank == 0 else contextlib.nullcontext()


def _barrier(name: str) -> None:
    """All rank processes meet here, over JAX's distributed key-value store (no device
    collective, which ranks sharing a GPU cannot run)."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(
        f"jax_fusedar_demo_{name}", int(BARRIER_TIMEOUT_S * 1000)
    )


def _mesh():
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices), (AXIS,))


def _greedy(prefill, decode, params, prompt, cache, steps):
    """llama.greedy_decode with the programs compiled first on every rank, then started
    together."""
    from ..models import llama

    tok1, pos_d = prompt[:, :1], jnp.int32(prompt.shape[1])
    pre = prefill.lower(params, prompt, *cache, jnp.int32(0)).compile()
    dec = decode.lower(params, tok1, *cache, pos_d).compile()
    return pre, dec, lambda: llama.greedy_decode(pre, dec, params, prompt, *cache, steps)


def run(args, p: Plan, rank: int):
    """This rank's part of the demo: (exit code, result for the launcher)."""
    require_fuse_jax()
    if args.bench:
        raise SetupError("--bench runs in one process driving a device per rank")
    mesh = _mesh()
    world = mesh.shape[AXIS]
    if world != p.world:
        raise SetupError(f"{world} devices joined, expected {p.world} (one per rank)")
    say = print if rank == 0 else (lambda *a, **k: None)
    if p.shared_gpus and args.layers is None and not getattr(args, "moe", False):
        args.layers = SHARED_GPU_LAYERS
        layers_note = (
            f" (the preset's first {SHARED_GPU_LAYERS} layers: ranks sharing a GPU "
            f"run slowly; --layers N for more)"
        )
    else:
        layers_note = ""
    where = (
        f"one process per rank sharing {p.gpus} GPU{'s' if p.gpus > 1 else ''} (rank r "
        f"on GPU r % {p.gpus})"
        if p.gpus
        else "one process per rank on CPUs (gloo)"
    )
    run_mode = _run_moe if getattr(args, "moe", False) else _run_dense
    tokens, ok = run_mode(args, p, rank, mesh, world, say, where, layers_note)
    _barrier("done")  # the others wait for rank 0's reference before shutting down
    return (0 if ok else 1), {"rank": rank, "tokens": tokens}


def _timing_line(p: Plan) -> str:
    if p.shared_gpus:
        return f"timings: none; {shared_gpu_timing(p.gpus, p.world)}"
    return "timings: none in one-process-per-rank mode ('--processes one' times the model)"


def _verdict(
    say, mode, toks_r, logs_r, toks_f, logs_f, tol, tol_text, steps, batch, expect_all_fused, report
) -> bool:
    first, err, scale, margins = compare_greedy(toks_r, logs_r, toks_f, logs_f)
    rel = err / scale if scale else float("inf")
    say(f"greedy tokens, sequence 0, reference: {toks_r[0].tolist()}")
    say(f"greedy tokens, sequence 0, fused:     {toks_f[0].tolist()}")
    if first is None:
        say(f"greedy tokens: identical over {steps} steps x {batch} sequences")
    else:
        say(
            f"greedy tokens: first divergence at step {first[0]}, sequence {first[1]} "
            f"({margins.replace('unfused', 'reference')})"
        )
    say(
        f"max logits error {err:.4g} (relative to max |logits| {scale:.4g}: {rel:.3e}; "
        f"tolerance {tol:.3e} = {tol_text})"
    )
    ok = (
        rel <= tol
        and (first is None or near_tie(logs_r, first, err))
        and (not expect_all_fused or len(report.fused) == len(report.sites) > 0)
    )
    say(f"{'PASS' if ok else 'FAIL'} ({mode})")
    return bool(ok)


def _require_fused(report, p: Plan, what: str) -> None:
    """Ranks sharing a GPU can run no XLA all-reduce: every site must be fused."""
    if p.shared_gpus and len(report.fused) != len(report.sites):
        raise SetupError(
            f"{what}: jax_fusedar.fuse left {len(report.sites) - len(report.fused)} of "
            f"{len(report.sites)} all-reduce sites unfused ({dict(report.reasons())}); their "
            f"psum would run on XLA's NCCL all-reduce, which refuses ranks sharing a GPU"
        )


def _replicated(mesh, value):
    from ..models import llama

    return llama.place(value, NamedSharding(mesh, P()))


def _run_dense(args, p, rank, mesh, world, say, where, layers_note):
    from ..fusion.transform import fuse
    from ..models import llama

    preset, cfg = llama_preset(args, world)
    dtype = jnp.dtype(args.dtype)
    on_gpu = p.gpus > 0
    host = not on_gpu
    stacked = llama.init_params(cfg, mesh, AXIS, dtype, args.seed, host=host, vocab_parallel=False)
    prompt_np = (
        np.random.default_rng(args.seed + 1)
        .integers(0, cfg.vocab, (args.batch, args.prompt))
        .astype(np.int32)
    )
    prompt = _replicated(mesh, prompt_np)
    length = args.prompt + args.steps
    norm = llama.NORMS[args.norm]
    say(
        f"jax_fusedar demo: Llama decoder ({preset}: {cfg.layers} layers{layers_note}, hidden "
        f"{cfg.hidden}, ffn {cfg.ffn}, {cfg.heads}/{cfg.kv_heads} heads, vocab {cfg.vocab}), "
        f"{args.dtype}, random weights (seed {args.seed}), tensor parallel over {world} "
        f"ranks, {where}; batch {args.batch}, prompt {args.prompt}, {args.steps} greedy "
        f"steps; norm {args.norm}"
    )
    say(
        "the model calls no jax_fusedar function; 'fused' = jax_fusedar.fuse(model) on the "
        "ranks, 'reference' = the same model unsharded on one device of rank 0"
    )
    say(_timing_line(p))
    fused_out = {}
    with open_workspace(
        mesh,
        max_token_num=args.batch * args.prompt,
        hidden_dim=cfg.hidden,
        dtype=dtype,
        backend=args.backend,
    ) as ws:
        say(describe_devices(world, ws.backend, p))
        for mode in _modes(args):
            fwd = llama.make_forward(
                cfg, mesh, AXIS, scan=mode == "scan", norm=norm, vocab_parallel=False
            )
            fused = fuse(fwd, workspace=ws, allow_rounding_change=args.allow_rounding_change)
            params = llama.arrange(stacked, mesh, AXIS, scan=mode == "scan", vocab_parallel=False)
            cache = llama.init_cache(cfg, mesh, AXIS, dtype, args.batch, length)
            reports = {
                "prefill": fused.analyze(params, prompt, *cache, jnp.int32(0)),
                "decode": fused.analyze(params, prompt[:, :1], *cache, jnp.int32(args.prompt)),
            }
            for what, rep in reports.items():
                _require_fused(rep, p, f"{what} ({mode})")
            prog = jax.jit(fused)
            with _phase(rank, f"compiling the fused prefill and decode programs (layers {mode})"):
                *_, decode = _greedy(prog, prog, params, prompt, cache, args.steps)
                _barrier(f"compiled_{mode}")
            with _phase(rank, f"running the fused programs on every rank (layers {mode})"):
                fused_out[mode] = (decode(), reports)
            del params, cache
    tokens = {mode: out[0][0].tolist() for mode, out in fused_out.items()}
    if rank != 0:
        return tokens, True
    expect_all = True  # both norms fuse (Hugging Face's gamma stays after the fused norm)
    ok = True
    dev = jax.local_devices()[0]
    mesh1 = Mesh(np.array([dev]), (AXIS,))
    ref = llama.init_params(cfg, mesh1, AXIS, dtype, args.seed, host=host)
    if not host:  # drawn packed for one rank: read as the TP group's packing
        ref = jax.jit(lambda t: llama.repack_columns(t, cfg, world, 1))(ref)
    prompt1 = jax.device_put(prompt_np, dev)
    for mode, ((toks_f, logs_f), reports) in fused_out.items():
        fwd1 = llama.make_forward(cfg, mesh1, AXIS, scan=mode == "scan", norm=norm)
        params1 = llama.arrange(ref, mesh1, AXIS, scan=mode == "scan")
        cache1 = llama.init_cache(cfg, mesh1, AXIS, dtype, args.batch, length)
        prog1 = jax.jit(fwd1)
        with _phase(rank, f"compiling and running the reference on rank 0 (layers {mode})"):
            toks_r, logs_r = llama.greedy_decode(
                prog1, prog1, params1, prompt1, *cache1, args.steps
            )
        sites = reports["decode"]
        n_sites = sum(s.runs for s in sites.sites)
        say()
        say(f"== layers {mode} ==")
        for what, rep in reports.items():
            say(f"{what}: {rep.line()}")
        ok &= _verdict(
            say,
            mode,
            toks_r,
            logs_r,
            toks_f,
            logs_f,
            reference_tolerance(args.dtype, world, n_sites),
            f"{REFERENCE_TOLERANCE_FORMULA} with {n_sites} sites",
            args.steps,
            args.batch,
            expect_all,
            sites,
        )
    return tokens, ok


def _modes(args):
    return LAYER_MODES if args.layer_mode == "both" else (args.layer_mode,)


def _run_moe(args, p, rank, mesh, world, say, where, layers_note):
    from ..fusion.transform import fuse
    from ..models import llama, moe_llama

    name, cfg = moe_preset(args, world, on_gpu=p.gpus > 0)
    dtype = jnp.dtype(args.dtype)
    base = cfg.base
    params = moe_llama.init_params(cfg, mesh, AXIS, dtype, args.seed, vocab_parallel=False)
    prompt_np = (
        np.random.default_rng(args.seed + 1)
        .integers(0, base.vocab, (args.batch, args.prompt))
        .astype(np.int32)
    )
    prompt = _replicated(mesh, prompt_np)
    length = args.prompt + args.steps
    say(
        f"jax_fusedar demo --moe: Llama decoder with MoE MLPs ({name}: {base.layers} layers, "
        f"hidden {base.hidden}, {cfg.experts} experts top-{cfg.top_k} (expert ffn "
        f"{cfg.expert_ffn}) + a shared expert (ffn {cfg.shared_ffn}), {base.heads}/"
        f"{base.kv_heads} heads, vocab {base.vocab}), {args.dtype}, random weights (seed "
        f"{args.seed}), experts parallel over {world} ranks, {where}; batch {args.batch}, "
        f"prompt {args.prompt}, {args.steps} greedy steps"
    )
    say(
        "'fused' = the MoE finalize op, with the attention's all-reduces fused by "
        "jax_fusedar.fuse, on the ranks; 'reference' = the plain model unsharded on one "
        "device of rank 0"
    )
    say(_timing_line(p))
    with open_workspace(
        mesh,
        max_token_num=args.batch * args.prompt,
        hidden_dim=base.hidden,
        dtype=dtype,
        backend=args.backend,
    ) as ws:
        say(describe_devices(world, ws.backend, p))
        fwd = moe_llama.make_forward(
            cfg, mesh, AXIS, mlp=moe_llama.fused_moe_mlp(cfg, ws), vocab_parallel=False
        )
        fused = fuse(fwd, workspace=ws)
        cache = llama.init_cache(base, mesh, AXIS, dtype, args.batch, length)
        report = fused.analyze(params, prompt[:, :1], *cache, jnp.int32(args.prompt))
        _require_fused(report, p, "decode")
        prog = jax.jit(fused)
        with _phase(rank, "compiling the fused prefill and decode programs"):
            pre, _, decode = _greedy(prog, prog, params, prompt, cache, args.steps)
            kernel_calls = pre.as_text().count("jax_fusedar_moe_allreduce_fusion_v1")
            _barrier("compiled_moe")
        with _phase(rank, "running the fused programs on every rank"):
            toks_f, logs_f = decode()
    tokens = {"moe": toks_f[0].tolist()}
    if rank != 0:
        return tokens, True
    dev = jax.local_devices()[0]
    mesh1 = Mesh(np.array([dev]), (AXIS,))
    params1 = moe_llama.init_params(cfg, mesh1, AXIS, dtype, args.seed)
    prog1 = jax.jit(moe_llama.make_forward(cfg, mesh1, AXIS, mlp=moe_llama.plain_moe_mlp(cfg)))
    cache1 = llama.init_cache(base, mesh1, AXIS, dtype, args.batch, length)
    prompt1 = jax.device_put(prompt_np, dev)
    with _phase(rank, "compiling and running the reference on rank 0"):
        toks_r, logs_r = llama.greedy_decode(prog1, prog1, params1, prompt1, *cache1, args.steps)
    say(f"decode: {report.line()}")
    say(
        f"MoE combine sites through the fused op: {base.layers} per step (kernel custom calls "
        f"in the compiled prefill: {kernel_calls})"
    )
    # The tolerance: each layer's attention all-reduce is a dense site (fused on the ranks);
    # each MoE block a site scaled by the magnitudes that flow through it (measured on the
    # reference over the prompt), whose terms the kernel rounds moe_kernel_roundings times
    # and the reference once (its float32 sum).
    ratios = moe_llama.term_ratios(
        cfg,
        mesh1,
        AXIS,
        params1,
        prompt1,
        *llama.init_cache(base, mesh1, AXIS, dtype, args.batch, args.prompt),
        tp=world,
    )
    n = moe_kernel_roundings(cfg.top_k, world) + 1
    tol = moe_tolerance(args.dtype, ratios, n, dense_sites=base.layers, world=world)
    text = (
        f"{MOE_REFERENCE_TOLERANCE_FORMULA} with {base.layers} layers, n = {n}, m = "
        f"{' '.join(f'{m:.3g}' for m in sorted(ratios))}"
    )
    return tokens, _verdict(
        say, "moe", toks_r, logs_r, toks_f, logs_f, tol, text, args.steps, args.batch, True, report
    )
