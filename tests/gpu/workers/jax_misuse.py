"""One process driving two devices: misuse that only the GPU path could turn into a silent
wrong answer, and the numerics documented for extreme rows. ``python -m
tests.gpu.workers.jax_misuse PLATFORM`` (``cuda``: two GPUs, the kernel; ``cpu``: two virtual
devices, the reference path, so the plumbing runs in CI) prints ``RESULT {json}``:

* ``good``: a workspace on the mesh [d0, d1] called under that mesh (shard_map) and under
  ``jax.pmap(devices=[d0, d1])``: ulps against the float64 oracle, whether the two agree bit
  for bit, whether the lowered program has the custom call;
* ``flipped_shard_map`` / ``flipped_pmap``: the same workspace under the mesh [d1, d0] and
  ``pmap(devices=[d1, d0])``, the 2-device form of a regrouped mesh (each device would sum in
  the other order, or with more devices in the wrong group): the error, or "no error";
* ``overflow``: bf16 rows of |r| ~ 1e20, whose fp32 sum of squares overflows: whether norm_out
  is +-0 with the sign of r * gamma (README, Numerics), next to an ordinary row in bounds.
"""

import json
import os
import sys

import numpy as np

from tests.gpu.workers.common import jax_workspace, jit_shard_map


def main(platform: str) -> dict:
    os.environ["JAX_PLATFORMS"] = platform
    if platform == "cpu":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    else:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    import jax_fusedar as jf
    from jax_fusedar.ops.dense import FFI_TARGET
    from tests.oracles import oracle
    from tests.gpu.harness import draw_case
    from tests.gpu.workers.common import plain_ulps

    d = jax.devices()[:2]
    mesh, flipped = Mesh(np.array(d), ("tp",)), Mesh(np.array(d[::-1]), ("tp",))
    seed = int.from_bytes(os.urandom(4), "little")
    ws = jax_workspace(jf, mesh, 32, 1024, jnp.bfloat16)
    out = {"platform": platform, "backend": ws.backend, "devices": [str(x) for x in d]}
    out.update(seed=seed, jax=jax.__version__)

    def body(x, r, g):
        kw = dict(axis_name="tp", workspace=ws, strict=True)
        o = jf.allreduce_fusion(x, residual=r, rms_gamma=g, **kw)
        return o.residual_out, o.norm_out

    def sharded(m):
        return jit_shard_map(jax, body, m, (P("tp"), P(), P()), (P(), P()))

    def pmapped(devices):
        return jax.pmap(body, axis_name="tp", in_axes=(0, None, None), devices=devices)

    def place(m, xs, res, gam):
        put = lambda a, spec: jax.device_put(a, NamedSharding(m, spec))
        return put(np.concatenate(xs), P("tp")), put(res, P()), put(gam, P())

    # --- the workspace's own mesh and its pmap twin --------------------------------------------
    tokens, hidden = 17, 1024
    xs, res, gam = draw_case(seed, 2, tokens, hidden, jnp.bfloat16)
    args = place(mesh, xs, res, gam)
    r_out, n_out = sharded(mesh)(*args)
    r_p, n_p = pmapped(d)(np.stack(xs), res, gam)
    x64 = [x.astype(np.float64) for x in xs]
    r64, g64 = res.astype(np.float64), gam.astype(np.float64)
    got = dict(residual_out=np.asarray(r_out, np.float64), norm_out=np.asarray(n_out, np.float64))
    ulps = plain_ulps(x64, r64, g64, "bfloat16", **got)
    pairs = ((r_p, r_out), (n_p, n_out))
    u16, f32 = (lambda a: np.asarray(a).view(np.uint16)), (lambda a: np.asarray(a, np.float32))
    out["good"] = {
        "residual_ulps": ulps["residual"],
        "norm_ulps": ulps["norm"],
        # Bits (the kernel is deterministic), and values: XLA's CPU reference may give
        # a zero's sign differently in two differently fused programs.
        "pmap_equals_shard_map_bits": all(np.array_equal(u16(a[0]), u16(b)) for a, b in pairs),
        "pmap_equals_shard_map_values": all(np.array_equal(f32(a[0]), f32(b)) for a, b in pairs),
        "custom_call": FFI_TARGET in sharded(mesh).lower(*args).as_text(),
    }

    # --- the same devices in the other order -----------------------------------------------
    def error_of(thunk):
        try:
            thunk()
        except ValueError as e:
            return str(e)
        return "no error"

    fargs = place(flipped, xs, res, gam)
    out["flipped_shard_map"] = error_of(lambda: jax.block_until_ready(sharded(flipped)(*fargs)))
    out["flipped_shard_map_lower"] = error_of(lambda: sharded(flipped).lower(*fargs))
    out["flipped_pmap"] = error_of(
        lambda: jax.block_until_ready(pmapped(d[::-1])(np.stack(xs), res, gam))
    )

    # --- rows whose fp32 sum of squares overflows ------------------------------------------
    rng = np.random.default_rng(seed)
    big = rng.uniform(0.5, 1.0, (3, hidden)) * np.where(rng.random((3, hidden)) < 0.5, -1, 1)
    rows = np.concatenate([big * 1e20, rng.standard_normal((1, hidden))]).astype(jnp.bfloat16)
    zeros = np.zeros_like(rows)
    r_o, n_o = sharded(mesh)(*place(mesh, [rows, zeros], zeros, gam))
    n_o = np.asarray(n_o).astype(np.float32)
    want_sign = np.signbit(rows[:3].astype(np.float32)) ^ np.signbit(gam.astype(np.float32))
    row64, zero = rows[3:].astype(np.float64), np.zeros((1, hidden))
    rs, rr, ry, rinv = oracle.fused_reference([row64], zero, g64, rms_eps=1e-6, weight_bias=0.0)
    kw = dict(weight_bias=0.0, dtype_name="bfloat16")
    out["overflow"] = {
        "residual_exact": bool(np.array_equal(u16(r_o), rows.view(np.uint16))),
        "zero_rows": bool(np.all(n_o[:3] == 0.0)),
        "signs_of_r_times_gamma": bool(np.array_equal(np.signbit(n_o[:3]), want_sign)),
        "ordinary_row_norm_ulps": oracle.norm_error_ulps(
            n_o[3:].astype(np.float64), rs, ry, rinv, zero, g64, **kw
        ),
    }
    ws.destroy()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
