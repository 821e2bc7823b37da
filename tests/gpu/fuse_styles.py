"""Per-process body of the GPU test of ``jax_fusedar.fuse`` on the style models
(tests/models/styles.py): each fused on a (dp=1, tp=world) mesh, against the same model
unfused on this process's one device (NCCL cannot run two ranks on one GPU) in its dtype and
in float32. A fused program that keeps XLA collectives needs a GPU per rank (else skipped).
``platform="cpu"``: a dry run on CPU processes, fused on an abstract kernel workspace.
"""

from __future__ import annotations

import os
import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Against the float32 run: fused error <= RATIO * unfused error + FLOOR (relative RMS). The
# fused model is sharded: each rank's partial product is rounded to T before the sum, which
# the one-device unfused run never does (measured on CPU ranks: up to 1.21x).
RATIO, FLOOR = 1.5, 1e-3


def _setup(rank, world, port, platform):
    os.environ["JAX_PLATFORMS"] = platform
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    # The programs round where they are written: XLA's GPU compiler otherwise drops a
    # float32 -> bfloat16 -> float32 round trip (excess precision), the program's rounding
    # of gamma among them, and the units below would measure XLA's choice, not the op's.
    os.environ["XLA_FLAGS"] = "--xla_allow_excess_precision=false"
    import jax

    # float32 matmuls in float32 (not TF32): the float32 run is the yardstick.
    jax.config.update("jax_default_matmul_precision", "highest")
    from tests.gpu.harness import device_for
    from tests.gpu.workers.common import jax_distributed

    return jax_distributed(
        rank, world, port, platform, None if platform == "cpu" else [device_for(rank)]
    )


def _global(jax, value, sharding):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def captured(call):
    """``call()``'s result, or its error and traceback (per case: the other cases still run)."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001
        import traceback

        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def fusion_facts(fused, hlo):
    """Sites found and fused, fused custom calls and XLA collectives in the compiled HLO."""
    from jax_fusedar.ops.dense import FFI_TARGET

    return {
        "sites": len(fused.report.sites),
        "fused": len(fused.report.fused),
        "report": fused.report.line(),
        "custom_calls": len(re.findall(rf'custom_call_target="{FFI_TARGET}"', hlo)),
        "xla_collectives": [c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", hlo)],
    }


def _rel_rms(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((a - ref) ** 2) / max(np.mean(ref**2), 1e-300)))


def _one_style(jax, jf, style, cfg, mesh, seed, gpus, world, platform):
    import dataclasses

    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from tests.models.common import activations

    mod = style.module
    dtype = jnp.dtype(style.dtype)
    host_params = style.params(cfg, seed)
    host_x = np.asarray(activations(cfg, seed + 1, dtype))
    specs = _specs(mod, host_params)
    params = jax.tree.map(lambda v, s: _global(jax, v, NamedSharding(mesh, s)), host_params, specs)
    x = _global(jax, host_x, mod.input_sharding(mesh))
    if platform == "cuda":
        target = dict(mesh=mesh, axis_name="tp", backend="auto")
    else:
        # The kernel's backend, described (nothing allocated): fuse rewrites as on GPUs (on
        # the xla backend a sequence-parallel site stays as written), and the fused calls
        # run the reference on CPU.
        workspace = jf.abstract_workspace(
            mesh,
            "tp",
            max_token_num=cfg.tokens,
            hidden_dim=cfg.hidden,
            dtype=dtype,
            backend="trtllm",
        )
        target = dict(workspace=workspace)
    fused = jf.fuse(
        style.forward(cfg, mesh),
        **target,
        allow_rounding_change=style.allow_rounding_change,
        strict=True,
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(fused).lower(params, x).compile()
    out = fusion_facts(fused, compiled.as_text())
    left = out["xla_collectives"]
    if left and platform == "cuda" and gpus < world:
        out["skipped"] = (
            f"the fused program still has XLA collectives {left}, which NCCL "
            f"cannot run with {world} ranks on {gpus} GPU(s)"
        )
        fused.close()
        return out
    with jax.set_mesh(mesh):
        got = np.asarray(compiled(params, x).addressable_data(0), np.float64)
    fused.close()

    # The same model unfused, on this process's one device: no collective crosses processes.
    local = jax.local_devices()[0]
    mesh1 = jax.make_mesh((1, 1), ("dp", "tp"), axis_types=(style.axis_type,) * 2, devices=[local])

    def run_local(as_float32):
        st = dataclasses.replace(style, dtype="float32") if as_float32 else style
        cast = (lambda v: np.asarray(v, np.float32)) if as_float32 else np.asarray
        put = lambda v, s: jax.device_put(cast(v), NamedSharding(mesh1, s))
        p = jax.tree.map(put, host_params, specs)
        xx = jax.device_put(cast(host_x), mod.input_sharding(mesh1))
        with jax.set_mesh(mesh1):
            return np.asarray(jax.jit(st.forward(cfg, mesh1))(p, xx), np.float64)

    unfused, exact = run_local(False), run_local(True)
    out.update(
        fused_vs_f32=_rel_rms(got, exact),
        unfused_vs_f32=_rel_rms(unfused, exact),
        fused_vs_unfused_max_abs=float(np.max(np.abs(got - unfused))),
        finite=bool(np.isfinite(got).all()),
    )
    return out


def _specs(mod, host_params):
    """The PartitionSpec tree of a model's params (each module's SPECS per layer)."""
    from jax.sharding import PartitionSpec as P

    out = {}
    for key, value in host_params.items():
        if isinstance(value, list):
            out[key] = [{k: mod.SPECS[k] for k in layer} for layer in value]
        else:  # a stacked weight (scanned models) or a final norm
            out[key] = mod.SPECS.get(key, P())
    return out


def worker(rank, world, chan, *, port, seed, styles, platform="cuda", config=None):
    jax = _setup(rank, world, port, platform)
    import jax_fusedar as jf
    from jax_fusedar.common import native
    from tests.models.common import Config
    from tests.models.styles import BY_NAME

    cfg = Config(**(config or {}))
    gpus = native.gpu_count() if platform == "cuda" else world
    results = {"rank": rank, "jax": jax.__version__, "styles": {}}
    for name in styles:
        style = BY_NAME[name]
        mesh = jax.make_mesh((1, world), ("dp", "tp"), axis_types=(style.axis_type,) * 2)
        results["styles"][name] = captured(
            lambda: _one_style(jax, jf, style, cfg, mesh, seed, gpus, world, platform)
        )
        chan.barrier(f"style {name}")  # every rank runs the styles in one order
    jax.distributed.shutdown()
    return results


def fusion_problems(where, v, platform):
    """One case's error, a site missing or left unfused, or (on GPUs) fused custom calls in
    the compiled HLO other than the fused sites."""
    if "error" in v:
        return [f"{where}: {v['error']}\n{v.get('traceback', '')}"]
    problems = []
    if v["fused"] != v["sites"] or not v["sites"]:
        problems.append(f"{where}: {v['report']}")
    if platform == "cuda" and v["custom_calls"] != v["fused"]:
        problems.append(
            f"{where}: {v['custom_calls']} fused custom calls in the "
            f"compiled HLO, {v['fused']} sites fused"
        )
    return problems


def check(results, styles, *, platform="cuda"):
    """The problems found in the ranks' results (empty: pass)."""
    problems = []
    ran = 0
    for r in results:
        for name in styles:
            v = r["styles"].get(name, {"error": "missing"})
            problems += fusion_problems(f"rank {r['rank']} {name}", v, platform)
            if "error" in v or "skipped" in v:
                continue
            ran += 1
            if not v["finite"] or v["fused_vs_f32"] > RATIO * v["unfused_vs_f32"] + FLOOR:
                problems.append(f"rank {r['rank']} {name}: fused less accurate than unfused: {v}")
    if not ran:
        problems.append("every style was skipped")
    return problems
