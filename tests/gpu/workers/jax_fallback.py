"""Per-process body of the GPU test of the "xla" fallback (tests/gpu/test_fallback.py): one
``jax.distributed`` process per rank, rank r on GPU ``r % gpu_count``, a workspace on the
``xla`` backend (what TP across hosts gets), so every call runs the fallback: XLA's NCCL
all-reduce in the input's dtype, then the residual add and RMSNorm.

Ranks sharing a GPU: NCCL refuses two ranks of one communicator on one GPU of one host
("Duplicate GPU detected") and tells hosts apart by a hash of the host name, or of
``NCCL_HOSTID``: each rank sets its own, so NCCL sees one rank per host and connects them
through its socket transport over loopback (peer-to-peer and shared memory off), slowly.

For each dtype and case every rank compiles, on the same inputs, the fused call (pattern 1, and
pattern 0 for the sum) and what the user writes without jax_fusedar (psum, residual add,
RMSNorm in float32), reads the collectives of the compiled modules (tests/collectives.py), runs
them, and measures each output against the float64 oracle in the bounds of docs/numerics.md
(``oracle.psum_error_bound`` for the sum). ``platform="cpu"`` runs the same on CPU processes
over gloo (the CPU tests' dry run).
"""

import os

import numpy as np

from tests.gpu.workers.common import jax_workspace, jit_shard_map


def _setup(rank, world, port, platform):
    from jax_fusedar.common import native
    from tests.gpu.workers.jax_multiprocess import _setup

    shared = platform != "cpu" and native.gpu_count() < world
    if shared:  # NCCL: one "host" per rank, connected by its socket transport over loopback
        os.environ.update(NCCL_HOSTID=f"jax-fusedar-rank{rank}", NCCL_P2P_DISABLE="1")
        os.environ.update(NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", NCCL_NET="Socket")
        os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    if platform != "cpu":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (docs/decisions.md)
    return _setup(rank, world, port, "", platform), shared  # XLA_FLAGS empty


def _collectives(compiled):
    from tests import collectives

    text = compiled.as_text()
    return collectives.summary(collectives.hlo_collectives(text)), text


def worker(rank, world, chan, *, port, seed, cases, platform="cuda"):
    jax, shared = _setup(rank, world, port, platform)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import jax_fusedar as jf
    from jax_fusedar.ops.dense import FFI_TARGET
    from tests import collectives
    from tests.gpu.harness import draw_case, worst_of
    from tests.gpu.workers.jax_multiprocess import _global, _tp_mesh
    from tests.gpu.workers.jax_multiprocess import _local as local
    from tests.oracles import oracle

    mesh, AR = _tp_mesh(jax), jf.AllReduceFusionPattern.kAllReduce
    out = {"rank": rank, "world": world, "jax": jax.__version__, "shared_gpu": shared}
    out["devices"] = [str(d) for d in jax.devices()]
    glob = lambda spec, a: _global(jax, mesh, spec, a)

    eps = 1e-6
    results = {}
    case_id = 0
    for dtype in ("bfloat16", "float16", "float32"):
        jdt = jnp.dtype(dtype)
        tokens_max, hidden_max = max(m for m, _ in cases), max(h for _, h in cases)
        ws = jax_workspace(jf, mesh, tokens_max, hidden_max, jdt, backend="xla")
        assert ws.backend == "xla", ws
        w = results[dtype] = {"cases": 0, "hlo": []}
        for m, hidden in cases:
            case_id += 1
            xs, res, gam = draw_case(seed + case_id, world, m, hidden, jdt)
            wb = float(case_id % 2)

            def fused(x, r, g, wb=wb, acc=bool(case_id % 3)):  # the fallback ignores acc: psum
                kw = dict(axis_name="tp", workspace=ws, weight_bias=wb, rms_eps=eps, fp32_acc=acc)
                o = jf.allreduce_fusion(x, residual=r, rms_gamma=g, **kw)
                return o.residual_out, o.norm_out

            def fused_sum(x):
                kw = dict(axis_name="tp", workspace=ws, pattern=AR)
                return jf.allreduce_fusion(x, **kw).allreduce_out

            def plain(x, r, g, wb=wb):
                s = jax.lax.psum(x, "tp")
                r = s + r
                f = r.astype(jnp.float32)
                inv = jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + eps)
                y = (f * inv * (wb + g.astype(jnp.float32))).astype(r.dtype)
                return s, r, y

            args = (glob(P("tp"), xs[rank]), glob(P(), res), glob(P(), gam))
            progs = {
                "fused": (fused, (P("tp"), P(), P()), (P(), P()), args),
                "fused_sum": (fused_sum, (P("tp"),), P(), args[:1]),
                "plain": (plain, (P("tp"), P(), P()), (P(), P(), P()), args),
            }
            got, hlo = {}, {}
            for name, (fn, in_specs, out_specs, a) in progs.items():
                compiled = jit_shard_map(jax, fn, mesh, in_specs, out_specs).lower(*a).compile()
                summary, text = _collectives(compiled)
                calls = text.count(f'custom_call_target="{FFI_TARGET}"')
                hlo[name] = {"collectives": summary, "fused_custom_calls": calls}
                got[name] = compiled(*a)
            # The compiled modules: the fallback moves no more than the user's psum.
            for name in ("fused", "fused_sum"):
                costlier = collectives.costlier(
                    hlo[name]["collectives"], hlo["plain"]["collectives"]
                )
                hlo[name]["costlier_than_plain"] = costlier
            w["hlo"].append({"tokens": m, "hidden": hidden, **hlo})

            x64 = [x.astype(np.float64) for x in xs]
            r64, g64 = res.astype(np.float64), gam.astype(np.float64)
            s64, r_exact, _, _ = oracle.fused_reference(x64, r64, g64, rms_eps=eps, weight_bias=wb)
            bound = oracle.psum_error_bound(xs, dtype)
            r_bound = oracle.residual_error_bound(xs, res, dtype, sum_bound=bound)
            r_f, y_f = (local(o) for o in got["fused"])
            s_f = local(got["fused_sum"])
            s_p, r_p, y_p = (local(o) for o in got["plain"])
            kw = dict(rms_eps=eps, weight_bias=wb, dtype_name=dtype)
            errs = {
                "allreduce_bound": oracle.bound_ratio(s_f, s64, bound),
                "plain_allreduce_bound": oracle.bound_ratio(s_p, s64, bound),
                "residual_bound": oracle.bound_ratio(r_f, r_exact, r_bound),
                "plain_residual_bound": oracle.bound_ratio(r_p, r_exact, r_bound),
                "norm_own": oracle.norm_error_given_residual_ulps(y_f, r_f, g64, **kw),
                "plain_norm_own": oracle.norm_error_given_residual_ulps(y_p, r_p, g64, **kw),
            }
            worst_of(w, errs)
            # Information: how often the fused outputs equal the user's program's bits.
            same = bool(np.array_equal(r_f, r_p) and np.array_equal(y_f, y_p))
            w.setdefault("bitwise_equal", []).append(same)
            finite = all(np.isfinite(a).all() for a in (r_f, y_f, s_f))
            w["finite"] = w.get("finite", True) and bool(finite)
            w["cases"] += 1
        ws.destroy()
        chan.barrier(f"dtype {dtype}")
    out["results"] = results
    jax.distributed.shutdown()
    return out


def check(res):
    """The problems in the ranks' results (empty: pass)."""
    from tests.oracles import oracle

    problems = []
    for r in res:
        where = f"rank {r['rank']}"
        for dtype, w in r["results"].items():
            if not w["cases"]:
                problems.append(f"{where} {dtype}: no cases")
            if not w["finite"]:
                problems.append(f"{where} {dtype}: non-finite outputs")
            # plain_norm_own is reported only: XLA may compute the user's norm from the sum
            # before its rounding to the dtype (excess precision), which the fused op never does.
            bounds = ("allreduce_bound", "plain_allreduce_bound", "residual_bound")
            limits = dict.fromkeys((*bounds, "plain_residual_bound"), 1.0)
            limits["norm_own"] = oracle.NORM_GIVEN_RESIDUAL_ULPS[dtype]
            for k, v in limits.items():
                if not w[k] <= v:  # NaN fails too
                    problems.append(f"{where} {dtype}: {k} {w[k]} > {v}")
            for h in w["hlo"]:
                case = f"{where} {dtype} {h['tokens']}x{h['hidden']}"
                # The user's psum as XLA compiled it (on CPU XLA sums 16-bit all-reduces in
                # float32): one all-reduce of one rank's rows.
                want = h["plain"]["collectives"]
                rows = h["tokens"] * h["hidden"]
                ar = want.get("all_reduce", {})
                if ar.get("count") != 1 or ar.get("bytes") not in (2 * rows, 4 * rows):
                    problems.append(f"{case} plain: all-reduces {want}")
                for name in ("fused", "fused_sum"):
                    if h[name]["costlier_than_plain"]:
                        problems.append(f"{case} {name}: {h[name]['costlier_than_plain']}")
                    if h[name]["fused_custom_calls"]:
                        problems.append(f"{case} {name}: a fused custom call on the xla backend")
                    if h[name]["collectives"] != want:
                        got = h[name]["collectives"]
                        problems.append(f"{case} {name}: collectives {got}, the user's psum {want}")
    return problems
