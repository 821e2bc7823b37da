"""Shared helpers of the JAX CPU tests: 8 virtual CPU devices, meshes, random inputs and the
float64-oracle checks with their ulp bounds. tests/jax/conftest.py sets JAX_PLATFORMS /
XLA_FLAGS before any test module imports JAX (XLA reads the virtual device count once per
process); a test module calls ``require_host_devices()`` at module level."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.cpu_devices import HOST_DEVICES, HOST_DEVICES_FLAG
from tests.oracles import oracle
from tests.skips import native_skip_reason
import jax_fusedar as jf
from jax_fusedar.common import native
from jax_fusedar.common.patterns import TRAITS

SEED_ENV_VAR = "JAX_FUSEDAR_TEST_SEED"

DTYPES = ("bfloat16", "float16", "float32")
RMS_EPS = 1e-6

# Bounds in the oracle's ulps of the intermediate magnitudes (tests/oracles/oracle.py,
# docs/numerics.md).
ALLREDUCE_ULPS = 1.0
RESIDUAL_ULPS = 1.0
NORM_ULPS = {"bfloat16": 3.0, "float16": 3.0, "float32": 8.0}


# Lowering (and exporting) a trtllm workspace for cuda needs no native module; compiling a
# program that holds the kernel's call does, on CPU too (a ("cpu", "cuda") artifact's cuda
# branch compiles against the handler's host twin).
needs_native = pytest.mark.skipif(
    not native.available(),
    reason=native_skip_reason("compiling a program that calls the kernel (its host twin)"),
)


def require_host_devices(n: int = HOST_DEVICES) -> None:
    """Skips the calling module unless JAX runs on CPU with at least ``n`` devices."""
    devices = jax.devices()
    if devices[0].platform != "cpu" or len(devices) < n:
        pytest.skip(
            f"needs {n} CPU devices but JAX has {len(devices)} {devices[0].platform} device(s): "
            f"JAX was initialised before the module could set JAX_PLATFORMS=cpu and "
            f"XLA_FLAGS={HOST_DEVICES_FLAG}, or they were already set otherwise "
            f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}, "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}); run the CPU tests in a fresh process",
            allow_module_level=True,
        )


def new_rng() -> np.random.Generator:
    """A freshly seeded generator ($JAX_FUSEDAR_TEST_SEED replays a failure); the seed is
    printed, so pytest shows it with any failure of the test."""
    seed = int(os.environ.get(SEED_ENV_VAR) or int.from_bytes(os.urandom(8), "little"))
    print(f"random seed: {seed} (replay with {SEED_ENV_VAR}={seed})")
    return np.random.default_rng(seed)


def jdtype(dtype_name: str) -> np.dtype:
    return jnp.dtype(dtype_name)


def random_values(rng, shape, dtype_name: str) -> np.ndarray:
    """Standard normal values rounded to ``dtype_name``."""
    return rng.standard_normal(shape).astype(np.float32).astype(jdtype(dtype_name))


def random_partials(rng, shape, dtype_name: str) -> np.ndarray:
    """Per-rank partial sums (leading axes: [..., rank]) whose fp32 sum is exact in any order.

    The all-reduce accumulates in fp32 in an order the API does not fix, so it is within an
    ulp of |sum| only when that accumulation is exact; with cancellation a tiny partial loses
    bits (seven bf16 values of ~0.5 cancelling exactly plus 1.77e-6 came out 3 bf16 ulps off).
    So: normal values on a 2**-16 grid below 7.5 in magnitude, representable in every dtype
    and summing exactly in fp32 for up to 16 ranks (|sum| < 2**7 = 2**23 grid steps)."""
    x = np.clip(np.round(rng.standard_normal(shape) * 2.0**16) / 2.0**16, -7.5, 7.5)
    out = x.astype(np.float32).astype(jdtype(dtype_name))
    # Rounding to a 16-bit type keeps the grid: a multiple of 2**-16 stays one.
    assert np.all(np.round(out.astype(np.float64) * 2.0**16) == out.astype(np.float64) * 2.0**16)
    return out


def partials_of_kind(kind, rng, world, shape, dtype_name) -> np.ndarray:
    """Per-rank partial sums [world, *shape] in the call dtype, of a kind chosen to reach an
    all-reduce's error bound or not: normal (what the GPU tests draw); cancelling (rank r holds
    +-A_r with sum_r A_r ~ 0 plus a small term: each rounding of a large running sum counts
    against a small |s|, fp32_acc=False's worst case); growing (same-signed, partial sums
    growing with every rank); tiny (near the type's smallest normal: float16's subnormals)."""
    if kind == "normal":
        x = rng.standard_normal((world, *shape))
    elif kind == "cancelling":
        big = rng.uniform(50.0, 200.0, (world, *shape))
        big *= np.where(np.arange(world) % 2 == 0, 1.0, -1.0).reshape(-1, *[1] * len(shape))
        x = big + 1e-2 * rng.standard_normal((world, *shape))
    elif kind == "growing":
        x = rng.uniform(0.5, 1.5, (world, *shape))
    else:
        tiny = float(np.finfo(jdtype(dtype_name)).smallest_normal)
        x = rng.standard_normal((world, *shape)) * 4 * tiny
    return x.astype(np.float32).astype(jdtype(dtype_name))


def random_gamma(rng, hidden: int, dtype_name: str, leading=()) -> np.ndarray:
    return rng.uniform(-2.0, 2.0, (*leading, hidden)).astype(np.float32).astype(jdtype(dtype_name))


# --- meshes ------------------------------------------------------------------------------------


def make_mesh(shape, axis_names, device_ids=None) -> Mesh:
    """A mesh over the CPU devices ``device_ids`` (default: the first ones, in id order)."""
    by_id = {d.id: d for d in jax.devices()}
    ids = range(int(np.prod(shape))) if device_ids is None else device_ids
    return Mesh(np.array([by_id[i] for i in ids], dtype=object).reshape(shape), axis_names)


def mesh_2x4(axis_type=AxisType.Auto) -> Mesh:
    """A ("dp", "tp") mesh of 2 x 4 devices, both axes of ``axis_type``."""
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(axis_type,) * 2)


def tp_mesh(world: int = HOST_DEVICES) -> Mesh:
    """A 1-D ("tp",) mesh over the first ``world`` devices."""
    return make_mesh((world,), ("tp",))


def jit_shard_map(f, mesh, in_specs, out_specs, **kwargs):
    """``jax.jit(jax.shard_map(f, ...))``; ``kwargs`` go to shard_map (check_vma, ...)."""
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs))


def put(mesh: Mesh, spec: P, value) -> jax.Array:
    """Places a host array on ``mesh`` as ``spec`` says (shard_map requires it in JAX 0.10)."""
    return jax.device_put(value, NamedSharding(mesh, spec))


def run_sharded(f, mesh, in_specs, out_specs, *args):
    """``jit(shard_map(f))`` on host arrays placed as ``in_specs`` say (default check_vma)."""
    fn = jit_shard_map(f, mesh, in_specs, out_specs)
    return fn(*(put(mesh, spec, a) for spec, a in zip(in_specs, args)))


# --- workspaces and calls ----------------------------------------------------------------------


def xla_workspace(mesh, dtype="bfloat16", *, max_token_num=64, hidden_dim=256):
    """A workspace over ``mesh``'s "tp" axis on the xla backend (what CPU gets)."""
    kw = dict(max_token_num=max_token_num, hidden_dim=hidden_dim, dtype=jdtype(dtype))
    ws = jf.create_allreduce_fusion_workspace(mesh, "tp", **kw)
    assert ws.backend == "xla", ws
    return ws


def pattern_call(ws, pattern, x, r, g, kw):
    """allreduce_fusion of ``pattern`` on (x, residual r, gamma g; pattern 0 reads only x)
    with the options ``kw``: the outputs' NamedTuple."""
    if pattern == jf.AllReduceFusionPattern.kAllReduce:
        r = g = None
    return jf.allreduce_fusion(
        x, axis_name="tp", workspace=ws, pattern=pattern, residual=r, rms_gamma=g, **kw
    )


def pattern_outputs(ws, pattern, x, r, g, kw) -> tuple:
    """pattern_call's outputs that are not None."""
    return tuple(v for v in pattern_call(ws, pattern, x, r, g, kw) if v is not None)


def n_outputs(pattern):
    """How many outputs pattern_outputs gives."""
    t = TRAITS[pattern]
    return 1 if t.has_allreduce_out else 2 + bool(t.quant) + t.writes_scale_out


# --- the oracle --------------------------------------------------------------------------------


def kernel_rounding(partials, residual, dtype_name: str, *, fp32_acc: bool = True):
    """(allreduce_out, residual_out) rounded where the kernel rounds: s = T(sum), rounded once
    with fp32_acc (the partials must sum exactly in fp32, as random_partials' do), else after
    every addition in rank order; then r = T(float(s) + float(residual))."""
    t = jdtype(dtype_name)
    partials = np.asarray(partials)
    if fp32_acc or dtype_name == "float32":
        s = np.sum(partials.astype(np.float64), axis=0).astype(np.float32).astype(t)
    else:
        s = partials[0]
        for x in partials[1:]:
            s = (s.astype(np.float32) + x.astype(np.float32)).astype(t)
    r = (s.astype(np.float32) + np.asarray(residual).astype(np.float32)).astype(t)
    return s, r


def bits(a) -> np.ndarray:
    """The raw bits, so that -0.0 != 0.0 and NaN payloads count."""
    a = np.asarray(a)
    return a.view(f"u{a.itemsize}")


def check_outputs(
    dtype_name,
    partials,
    *,
    residual=None,
    gamma=None,
    weight_bias=0.0,
    rms_eps=RMS_EPS,
    what="",
    **outputs,
) -> dict:
    """Asserts that the given outputs (of shape [M, H] and the call dtype) match the float64
    oracle for the per-rank ``partials`` ([M, H] each) within the ulp bounds above; returns
    the errors. ``residual`` defaults to zeros, as in the API."""
    partials = [np.asarray(x) for x in partials]
    shape = partials[0].shape
    residual = np.zeros(shape, partials[0].dtype) if residual is None else np.asarray(residual)
    gamma = np.ones(shape[-1]) if gamma is None else np.asarray(gamma)
    f64 = lambda a: np.asarray(a).astype(np.float64)
    residual, gamma = f64(residual), f64(gamma)
    kw = dict(rms_eps=rms_eps, weight_bias=weight_bias)
    s, r, y, inv = oracle.fused_reference([f64(x) for x in partials], residual, gamma, **kw)
    error_ulps = {  # of the outputs given: allreduce_out, residual_out, norm_out
        "allreduce_out": lambda out: oracle.allreduce_error_ulps(out, s, dtype_name),
        "residual_out": lambda out: oracle.residual_error_ulps(out, s, r, residual, dtype_name),
        "norm_out": lambda out: oracle.norm_error_ulps(
            out, s, y, inv, residual, gamma, weight_bias=weight_bias, dtype_name=dtype_name
        ),
    }
    errors = {}
    for name, out in ((k, np.asarray(v)) for k, v in outputs.items() if v is not None):
        assert out.shape == shape and out.dtype == jdtype(dtype_name), (
            f"{what}: {name} is {out.shape} {out.dtype}, expected {shape} {dtype_name}"
        )
        errors[name] = error_ulps[name](out)
    bounds = dict(
        allreduce_out=ALLREDUCE_ULPS, residual_out=RESIDUAL_ULPS, norm_out=NORM_ULPS[dtype_name]
    )
    bad = {k: v for k, v in errors.items() if not v <= bounds[k]}  # NaN fails too
    assert not bad, (
        f"{what}: errors in ulps {bad} exceed the bounds "
        f"{ {k: bounds[k] for k in bad} } ({dtype_name}, weight_bias={weight_bias})"
    )
    return errors


def assert_same_bits(a, b, what):
    """The pytrees ``a`` and ``b`` have the same leaves, bit for bit (NaNs and signed zeros
    included), naming the first leaf that differs and in how many elements."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for i, (u, v) in enumerate(zip(la, lb)):
        u, v = np.asarray(u), np.asarray(v)
        same_kind = (u.dtype, u.shape) == (v.dtype, v.shape)
        assert same_kind, f"{what}: leaf {i} is {u.dtype} {u.shape}, not {v.dtype} {v.shape}"
        diff = np.count_nonzero(bits(u) != bits(v))
        assert diff == 0, f"{what}: leaf {i} differs in {diff} of {u.size} elements"


def fusedar_warnings(caplog) -> list[str]:
    """The messages of the WARNING records the jax_fusedar logger left in ``caplog``."""
    ours = [r for r in caplog.records if r.name == "jax_fusedar"]
    return [r.getMessage() for r in ours if r.levelno == logging.WARNING]


def cuda_text(traceable, *args) -> str:
    """StableHLO of jitted ``traceable`` traced at ``args``, lowered for cuda on this CPU."""
    return traceable.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def partitioned_shard_text(cfg, mesh, args, check_vma=False) -> str:
    """What XLA compiles on each GPU for a plain-jit site on Auto axes: the partition rule's
    per-shard program for ``cfg`` at the global ``args``, lowered for cuda in a manual region
    over ``mesh`` (as custom_partitioning does at compile time)."""
    from jax_fusedar.ops import partitioning

    _, local, outs, ins = partitioning.partition(cfg, mesh, args, None)
    specs = dict(in_specs=tuple(s.spec for s in ins), out_specs=tuple(s.spec for s in outs))
    f = jax.shard_map(local, mesh=mesh, check_vma=check_vma, **specs)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(args, ins)]
    return cuda_text(jax.jit(f), *placed)


def moe_body(ws, pattern, **kwargs):
    """(body, output count) of one MoE call in shard_map on inputs stacked per rank (leading
    dim 1 per rank): pattern 6 maps (expert_outputs, expert_scales, token_input, residual,
    gamma) to residual_out, norm_out, allreduce_out; pattern 7 (permuted_input, index map,
    expert_scale_factor, residual, gamma) to residual_out, norm_out."""
    kwargs = dict(axis_name=ws.axis_name, workspace=ws, **kwargs)

    def reduction(outputs, scales, token_input, residual, gamma):
        kw = dict(residual=residual, rms_gamma=gamma, return_allreduce_out=True, **kwargs)
        out = jf.moe_reduction_allreduce_fusion(outputs[0], scales[0], token_input[0], **kw)
        return out.residual_out, out.norm_out, out.allreduce_out

    def finalize(permuted, idx, scale, residual, gamma):
        kw = dict(residual=residual, rms_gamma=gamma, expert_scale_factor=scale[0], **kwargs)
        out = jf.moe_finalize_allreduce_fusion(permuted[0], idx[0], **kw)
        return out.residual_out, out.norm_out

    return (reduction, 3) if int(pattern) == 6 else (finalize, 2)
