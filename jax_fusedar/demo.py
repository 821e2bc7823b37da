"""``python -m jax_fusedar demo``: a small tensor-parallel decoder, fused vs unfused.

Each layer is an attention-free MLP block split Megatron-style over the mesh axis "tp":

    up      = act(h @ W_up[:, my columns])           column-parallel, no communication
    partial = up @ W_down[my rows, :]                row-parallel: this rank's share of the sum
    residual, h = all-reduce(partial) + residual, RMSNorm(...) * gamma_layer

The last step is either ``jax_fusedar.allreduce_fusion`` (fused) or ``lax.psum`` followed by
the residual add and RMSNorm written out in jnp (unfused, no jax_fusedar code: an independent
baseline). Both run the same weights in the same jitted shard_map, so any difference comes from
the combine step alone.
"""
from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import topology
from .api import allreduce_fusion
from .workspace import create_allreduce_fusion_workspace

AXIS = "tp"
RMS_EPS = 1e-6
ACTIVATIONS = {"gelu": jax.nn.gelu, "silu": jax.nn.silu}


class SetupError(ValueError):
    """A configuration this machine cannot run; the CLI prints it without a traceback."""


# --- shared with bench.py ------------------------------------------------------------------------

def tp_mesh():
    """A 1-D mesh over every local device, axis "tp"."""
    devices = jax.devices()
    return jax.make_mesh((len(devices),), (AXIS,), devices=devices)


def check_supported(world: int, hiddens, dtype: str) -> None:
    """Refuse up front what the fused op would refuse, on every backend alike."""
    for hidden in hiddens:
        problem = topology.kernel_support_problem(world, hidden, dtype)
        if problem:
            raise SetupError(f"{problem} (this machine has {world} device(s) of kind "
                             f"{jax.devices()[0].device_kind!r})")


def open_workspace(mesh, *, max_token_num: int, hidden_dim: int, dtype, backend: str):
    """The workspace, with the reasons it cannot be built (e.g. --backend trtllm without a
    GPU) reported as SetupError."""
    try:
        return create_allreduce_fusion_workspace(mesh, AXIS, max_token_num=max_token_num,
                                                 hidden_dim=hidden_dim, dtype=dtype,
                                                 backend=backend)
    except ValueError as e:
        raise SetupError(str(e)) from None


def describe_devices(world: int, backend: str) -> str:
    d = jax.devices()[0]
    path = ("FlashInfer kernel" if backend == "trtllm"
            else "XLA reference path (psum + RMSNorm), not the kernel")
    return (f"devices: {world} x {d.device_kind} (platform {d.platform}), world size {world}, "
            f"backend {backend}: {path}")


def plain_add_rmsnorm(partial, residual, gamma, *, eps: float = RMS_EPS):
    """The unfused combine as a model would write it: psum in the model dtype (what NCCL does),
    residual add, RMSNorm in float32. Returns (residual_out, norm_out)."""
    residual = jax.lax.psum(partial, AXIS) + residual
    r = residual.astype(jnp.float32)
    norm = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + eps)
    return residual, (norm * gamma.astype(jnp.float32)).astype(residual.dtype)


def timed_runs(fn, args, runs: int) -> list:
    """Seconds of each of ``runs`` calls, each waited for; after a warm-up call, which also
    compiles, so that neither is timed."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


# --- the model -----------------------------------------------------------------------------------

def init_params(seed: int, *, layers: int, tokens: int, hidden: int, ffn: int, dtype):
    """Random embeddings, weights scaled by 1/sqrt(fan-in) so activations stay O(1) through
    the layers, and gammas near 1 (random, so a gamma mix-up between layers shows)."""
    rng = np.random.default_rng(seed)
    arrays = {
        "emb": rng.standard_normal((tokens, hidden)),
        "w_up": rng.standard_normal((layers, hidden, ffn)) / math.sqrt(hidden),
        "w_down": rng.standard_normal((layers, ffn, hidden)) / math.sqrt(ffn),
        "gamma": 1.0 + 0.1 * rng.standard_normal((layers, hidden)),
    }
    return {k: v.astype(np.float32).astype(dtype) for k, v in arrays.items()}


# Column-parallel W_up is split on its output (ffn) dim, row-parallel W_down on its input dim.
PARAM_SPECS = {"emb": P(), "w_up": P(None, None, AXIS), "w_down": P(None, AXIS, None),
               "gamma": P()}


def forward(params, *, combine, act):
    """Per-rank body: returns every layer's norm output, stacked [layers, tokens, hidden];
    the last one is the model output."""
    h = residual = params["emb"]
    dtype = h.dtype
    outs = []
    for layer in range(params["w_up"].shape[0]):
        up = act(jnp.dot(h, params["w_up"][layer], preferred_element_type=jnp.float32))
        partial = jnp.dot(up.astype(dtype), params["w_down"][layer],
                          preferred_element_type=jnp.float32).astype(dtype)
        residual, h = combine(partial, residual, params["gamma"][layer])
        outs.append(h)
    return jnp.stack(outs)


def tolerance(dtype: str, world: int, layers: int) -> float:
    """Bound on max|fused - unfused| / max|unfused| for the output of layer ``layers``.

    Per layer the two combines round differently: the fused op sums in float32 and rounds
    once, a psum in the model dtype rounds after each of its world - 1 additions (independent
    errors of at most u = eps/2 each, so about sqrt(world - 1) * u together), and the residual
    add rounds that differing sum, which can land one ulp (eps relative) apart. XLA may also
    keep excess precision differently in the two programs, which is the same kind of one-ulp
    difference. The residual stream carries every layer's difference forward (the MLP's gain
    is ~1 at this init), so the terms add up over layers; the RMS normalisation maps the
    stream's relative error to the output's, whose own rounding adds one more eps.
    """
    eps = float(jnp.finfo(dtype).eps)
    return eps + layers * (eps + math.sqrt(world - 1) * eps / 2)


TOLERANCE_FORMULA = "eps + layers * (eps + sqrt(world - 1) * eps / 2)"


def main(args) -> int:
    mesh = tp_mesh()
    world = mesh.shape[AXIS]
    ffn = args.ffn_mult * args.hidden
    check_supported(world, [args.hidden], args.dtype)
    if ffn % world:
        raise SetupError(f"ffn size {ffn} (--ffn-mult {args.ffn_mult} x --hidden {args.hidden}) "
                         f"does not split over {world} devices")
    dtype = jnp.dtype(args.dtype)
    params = init_params(args.seed, layers=args.layers, tokens=args.tokens, hidden=args.hidden,
                         ffn=ffn, dtype=dtype)
    params = {k: jax.device_put(v, NamedSharding(mesh, PARAM_SPECS[k])) for k, v in params.items()}
    act = ACTIVATIONS[args.activation]

    with open_workspace(mesh, max_token_num=args.tokens, hidden_dim=args.hidden, dtype=dtype,
                        backend=args.backend) as ws:
        def fused(partial, residual, gamma):
            out = allreduce_fusion(partial, axis_name=AXIS, workspace=ws, residual=residual,
                                   rms_gamma=gamma, rms_eps=RMS_EPS)
            return out.residual_out, out.norm_out

        def model(combine):
            body = lambda p: forward(p, combine=combine, act=act)
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PARAM_SPECS,), out_specs=P()))

        runs = {"fused": model(fused), "unfused": model(plain_add_rmsnorm)}
        outputs = {name: np.asarray(fn(params), dtype=np.float64) for name, fn in runs.items()}
        seconds = {name: statistics.median(timed_runs(fn, (params,), args.iters))
                   for name, fn in runs.items()}
        backend = ws.backend

    print(f"jax_fusedar demo: {args.layers}-layer tensor-parallel MLP decoder, tokens "
          f"{args.tokens}, hidden {args.hidden}, ffn {ffn}, {args.dtype}, {args.activation}, "
          f"seed {args.seed}")
    print(describe_devices(world, backend))
    print()
    print("fused (jax_fusedar.allreduce_fusion) vs unfused (lax.psum + add + RMSNorm in jnp)")
    print(f"{'output':<14} {'max abs err':>12} {'max rel err':>12} {'tolerance':>12}")
    for layer in range(args.layers):
        diff = np.max(np.abs(outputs["fused"][layer] - outputs["unfused"][layer]))
        rel = diff / np.max(np.abs(outputs["unfused"][layer]))
        tol = tolerance(args.dtype, world, layer + 1)
        print(f"{f'layer {layer + 1} norm':<14} {diff:>12.3e} {rel:>12.3e} {tol:>12.3e}")
    # The last layer's norm output is the model output: repeated as the row that gates.
    print(f"{'final output':<14} {diff:>12.3e} {rel:>12.3e} {tol:>12.3e}")
    print(f"max rel err = max|fused - unfused| / max|unfused|; tolerance = {TOLERANCE_FORMULA} "
          f"with eps = {float(jnp.finfo(dtype).eps):.3g} ({args.dtype}), world = {world}, "
          f"layers = the layer's depth")
    print()
    print(f"{'run':<8} {'median ms':>10}   (of {args.iters} runs after warm-up)")
    for name, s in seconds.items():
        print(f"{name:<8} {s * 1e3:>10.3f}")
    print(f"fused / unfused: {seconds['fused'] / seconds['unfused']:.3f}")
    print()
    # Written as "not <=" so that a NaN anywhere in the outputs fails too.
    if not rel <= tol:
        print(f"FAIL: final output rel err {rel:.3e} exceeds the tolerance {tol:.3e}")
        return 1
    print(f"PASS: final output rel err {rel:.3e} <= tolerance {tol:.3e}")
    return 0
