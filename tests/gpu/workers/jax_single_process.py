"""One JAX process driving every local GPU (``--platform cuda``) or 8 CPU devices (``--platform
cpu``: tests/jax/test_jit_export_worker_plumbing.py). Each task prints ``RESULT <json>``:

* ``jit``:    tests/jax/sharded_model.py's 4-layer model under plain jit on Auto axes (Shardy +
              custom_partitioning) and on Explicit axes against its shard_map version: bitwise
              equal?; the compiled HLO's fused custom calls and all-reduces.
* ``export``: exports the shard_map layer for ("cpu", "cuda") with ``abstract_workspace``
              (nothing allocated); writes the artifact, the inputs and the workspace id.
* ``serve``:  in a fresh process, the artifact called before its workspace exists (the error),
              then with it: bitwise equal to the layer jitted here?; the kernel's host
              launches; the fused calls in the compiled artifact (on CPU: the dead cuda branch's).
"""

import argparse
import contextlib
import json
import os
import sys

import numpy as np

from tests.gpu.workers.common import jax_workspace, jit_shard_map

NAME = "served-layer"
TOKENS, HIDDEN = 16, 4096


def _setup(platform: str):
    if platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    else:
        os.environ["JAX_PLATFORMS"] = "cuda"
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # The bitwise comparisons are between two programs (plain jit vs shard_map). XLA's
        # GEMM autotuner times candidate kernels at each compilation, so the same dot can
        # get a different tiling (a different summation order) in each program; without
        # it, equal shapes get equal kernels and what is compared is jax_fusedar's part.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"
        ).strip()
    import jax

    return jax


def _fused_calls(hlo: str) -> int:
    from jax_fusedar.ops.dense import FFI_TARGET

    return hlo.count(f'custom_call_target="{FFI_TARGET}"')


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.itemsize}")


def _finite(arrays):
    return bool(all(np.isfinite(g.astype(np.float32)).all() for g in arrays))


def task_jit(jax, seed: int) -> dict:
    import jax.numpy as jnp
    from jax.sharding import AxisType
    import jax_fusedar as jf
    from tests.jax.sharded_model import BATCH, SEQ, jit_model, model_params, place
    from tests.jax.sharded_model import HIDDEN as H, shard_map_model

    n = len(jax.devices())
    dp = 2 if n >= 4 else 1
    out = {"devices": [str(d) for d in jax.devices()], "seed": seed}
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        rng = np.random.default_rng(seed)
        mesh = jax.make_mesh((dp, n // dp), ("dp", "tp"), axis_types=(axis_type,) * 2)
        with jax_workspace(jf, mesh, BATCH * SEQ, H, jnp.bfloat16) as ws:
            x = rng.standard_normal((BATCH, SEQ, H)).astype(np.float32).astype(jnp.bfloat16)
            params, x = place(mesh, model_params(rng), x)
            want = [np.asarray(a) for a in shard_map_model(mesh, ws)(params, x)]
            fn = jax.jit(lambda p, x: jit_model(p, x, workspace=ws))
            explicit = axis_type == AxisType.Explicit
            with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
                got, hlo = fn(params, x), fn.lower(params, x).compile().as_text()
            got = [np.asarray(a) for a in got]
            pairs = list(zip(got, want))
            out[axis_type.name] = {
                "backend": ws.backend,
                "bitwise_equal": all(np.array_equal(_bits(g), _bits(w)) for g, w in pairs),
                # Where they differ: how many elements, and by how much.
                "differing_elements": [int((_bits(g) != _bits(w)).sum()) for g, w in pairs],
                "max_abs_difference": [
                    float(np.abs(g.astype(np.float64) - w.astype(np.float64)).max())
                    for g, w in pairs
                ],
                "finite": _finite(got),
                "fused_calls_in_hlo": _fused_calls(hlo),
                "all_reduces_in_hlo": hlo.count("all-reduce("),
            }
    return out


def _layer(jax, jf, mesh, ws):
    from jax.sharding import PartitionSpec as P

    def body(partial, residual, gamma):
        kw = dict(axis_name="tp", workspace=ws)
        out = jf.allreduce_fusion(partial, residual=residual, rms_gamma=gamma, **kw)
        return out.residual_out, out.norm_out

    return jit_shard_map(jax, body, mesh, (P("tp"), P(), P()), (P(), P()))


def task_export(jax, path: str, seed: int) -> dict:
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    import jax_fusedar as jf

    mesh = jax.make_mesh((len(jax.devices()),), ("tp",))
    n = mesh.shape["tp"]
    kw = dict(max_token_num=TOKENS, hidden_dim=HIDDEN, dtype=jnp.bfloat16, name=NAME)
    ws = jf.abstract_workspace(mesh, "tp", **kw)
    shapes = (((n * TOKENS, HIDDEN), P("tp")), ((TOKENS, HIDDEN), P()), ((HIDDEN,), P()))
    sds = lambda s, sp: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, sp))
    specs = [sds(s, sp) for s, sp in shapes]
    exported = jf.export.export(_layer(jax, jf, mesh, ws), platforms=("cpu", "cuda"))(*specs)
    with open(path + ".bin", "wb") as f:
        f.write(exported.serialize())
    rng = np.random.default_rng(seed)
    partial = rng.standard_normal((n * TOKENS, HIDDEN)).astype(np.float32)
    residual = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    gamma = rng.uniform(-2, 2, HIDDEN).astype(np.float32)
    np.savez(path + ".npz", partial=partial, residual=residual, gamma=gamma)
    return {"workspace_id": ws.id, "ids_in_artifact": jf.export.workspace_ids(exported)}


def task_serve(jax, path: str) -> dict:
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    import jax_fusedar as jf

    mesh = jax.make_mesh((len(jax.devices()),), ("tp",))
    with open(path + ".bin", "rb") as f:
        exported = jf.export.deserialize(f.read())
    data = np.load(path + ".npz")
    put = lambda k, s: jax.device_put(data[k].astype(jnp.bfloat16), NamedSharding(mesh, s))
    args = [put(k, s) for k, s in (("partial", P("tp")), ("residual", P()), ("gamma", P()))]
    out = {"devices": [str(d) for d in jax.devices()]}
    kw = dict(max_token_num=TOKENS, hidden_dim=HIDDEN, dtype=jnp.bfloat16)
    # A workspace under another name does not match the artifact's key.
    with jf.create_allreduce_fusion_workspace(mesh, "tp", name="another", **kw) as other:
        out["other_backend"] = other.backend
        try:
            jax.block_until_ready(exported.call(*args))
            out["missing_workspace_error"] = "no error"
        except Exception as e:  # XlaRuntimeError from the handler
            out["missing_workspace_error"] = str(e)[:400]
    with jf.create_allreduce_fusion_workspace(mesh, "tp", name=NAME, **kw) as ws:
        out.update(backend=ws.backend, workspace_id=ws.id)
        from jax_fusedar.common import native

        launches = native.ext.launch_count() if native.available() else 0
        got = [np.asarray(a) for a in exported.call(*args)]
        out["kernel_launches"] = (native.ext.launch_count() if native.available() else 0) - launches
        want = [np.asarray(a) for a in _layer(jax, jf, mesh, ws)(*args)]
        hlo = jax.jit(exported.call).lower(*args).compile().as_text()
    out["bitwise_equal"] = all(np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, want))
    out.update(finite=_finite(got), fused_calls_in_hlo=_fused_calls(hlo))
    out["shapes"] = [list(g.shape) for g in got]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("task", choices=("jit", "export", "serve"))
    ap.add_argument("--platform", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--path", default="")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    jax = _setup(a.platform)
    tasks = {"jit": lambda: task_jit(jax, a.seed), "serve": lambda: task_serve(jax, a.path)}
    result = tasks.get(a.task, lambda: task_export(jax, a.path, a.seed))()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
