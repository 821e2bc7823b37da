"""Per-process body of the multi-node layout tests: `jax.distributed` processes that look like
separate hosts (``harness.simulate_host``), on one machine. Each builds the same meshes over
the global devices (ordered by process: host h holds [h*L, (h+1)*L)) and, per layout and
backend, records what the workspace chose (or the error), the lowering's kernel custom calls
and XLA all-reduces and, where it runs, each local output against the float64 oracle. On
platform "cpu" ``abstract_workspace`` decides (as on CUDA GPUs with these hosts) and the
program, lowered for cuda, runs on CPU over gloo; on "cuda" ``create_allreduce_fusion_workspace``
decides and the program runs on the GPUs (the kernel or XLA's NCCL all-reduce).

Layouts (P processes = hosts, L devices each; one needing more devices is skipped):

* "dp_across_hosts": ("dp", "tp") = (P, L), every TP group inside one host;
* "tp_across_hosts": ("dp", "tp") = (L, P), every TP group across all hosts;
* "mixed_groups":    ("pp", "dp", "tp") = (2, 2, 2) over devices [0, 1, 2, 4, 3, 5, 6, 7]:
                     TP groups [0, 1] and [6, 7] inside a host, [2, 4] and [3, 5] across;
* "tp_and_pp":       ("pp", "dp", "tp") = (2, 2, 2) in host order: TP inside a host, PP
                     across; one program with a fused call over each, each its own workspace.
"""

import logging
import os

import numpy as np

from tests.gpu.workers.common import jit_shard_map, keep_max

TOKENS, HIDDEN, DTYPE = 8, 256, "bfloat16"

LAYOUTS = {
    # name: (axis names, shape from (P, L), device order from (P, L), workspace axes)
    "dp_across_hosts": (("dp", "tp"), lambda p, l: (p, l), None, ("tp",)),
    "tp_across_hosts": (("dp", "tp"), lambda p, l: (l, p), "transpose", ("tp",)),
    "mixed_groups": (("pp", "dp", "tp"), lambda p, l: (2, 2, 2), [0, 1, 2, 4, 3, 5, 6, 7], ("tp",)),
    "tp_and_pp": (("pp", "dp", "tp"), lambda p, l: (2, 2, 2), None, ("tp", "pp")),
}


class _Reasons(logging.Handler):
    """Collects jax_fusedar's "uses XLA's all-reduce" warnings (each must come once)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        if "uses XLA's all-reduce" in record.getMessage():
            self.messages.append(record.getMessage())


def _setup(rank, world, port, platform, local_devices, device_ids):
    os.environ["JAX_PLATFORMS"] = platform
    if platform == "cpu":
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    else:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    from tests.gpu.workers.common import jax_distributed

    # On CPU, cross-process collectives over gloo (the reference path's psum).
    return jax_distributed(rank, world, port, platform, device_ids, initialization_timeout=60)


def _mesh(jax, name, world, local):
    from jax.sharding import Mesh

    axes, shape_of, order, ws_axes = LAYOUTS[name]
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    shape = shape_of(world, local)
    if len(devices) != int(np.prod(shape)):
        return None, ws_axes
    if order == "transpose":
        grid = np.array(devices, dtype=object).reshape(world, local).T
    else:
        ordered = [devices[i] for i in (order or range(len(devices)))]
        grid = np.array(ordered, dtype=object).reshape(shape)
    return Mesh(grid, axes), ws_axes


def _program(jax, jf, mesh, workspaces):
    """shard_map over every mesh axis, each device holding its own partials: the fused call
    over each workspace's axis; (residual_out, norm_out) per workspace, that axis kept, size 1."""
    from jax.sharding import PartitionSpec as P

    axes = tuple(mesh.axis_names)
    keep = (1,) * len(axes)

    def body(x, residual, gamma):
        outs = []
        for ws in workspaces:
            kw = dict(axis_name=ws.axis_name, workspace=ws, residual=residual, rms_gamma=gamma)
            o = jf.allreduce_fusion(x.reshape(TOKENS, HIDDEN), **kw)
            outs += [a.reshape(keep + (TOKENS, HIDDEN)) for a in (o.residual_out, o.norm_out)]
        return tuple(outs)

    spec = lambda ws: P(*[None if a == ws.axis_name else a for a in axes])
    out_specs = tuple(spec(ws) for ws in workspaces for _ in range(2))
    return jit_shard_map(jax, body, mesh, (P(*axes), P(), P()), out_specs)


def _avals(jax, mesh, dtype):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shapes = ((mesh.devices.shape + (TOKENS, HIDDEN), P(*mesh.axis_names)), ((TOKENS, HIDDEN), P()))
    shapes += (((HIDDEN,), P()),)
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    return [sds(shape, spec) for shape, spec in shapes]


def _check_outputs(jax, mesh, workspaces, fn, dtype, seed):
    """Runs fn on fresh partials; the worst ulps of this process's shards of every residual_out
    and norm_out against its group's float64 oracle."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tests.oracles import oracle

    rng = np.random.default_rng(seed)
    partials = rng.standard_normal(mesh.devices.shape + (TOKENS, HIDDEN), dtype=np.float32)
    partials = partials.astype(dtype)
    residual = rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32).astype(dtype)
    gamma = rng.uniform(-2, 2, HIDDEN).astype(np.float32).astype(dtype)

    def put(value, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

    outs = fn(put(partials, P(*mesh.axis_names)), put(residual, P()), put(gamma, P()))
    worst = {"residual": 0.0, "norm": 0.0, "shards": 0}
    for i, ws in enumerate(workspaces):
        # Every group's sum over its members: the workspace's axis summed, kept with size 1.
        axis = mesh.axis_names.index(ws.axis_name)
        group_sum = partials.astype(np.float64).sum(axis=axis, keepdims=True)
        s, r64, y64, inv = oracle.fused_reference(
            [group_sum], residual, gamma, rms_eps=1e-6, weight_bias=0.0
        )
        for got_r, got_n in zip(outs[2 * i].addressable_shards, outs[2 * i + 1].addressable_shards):
            idx = got_r.index
            assert got_n.index == idx
            r_got, y = np.asarray(got_r.data), np.asarray(got_n.data)
            r = oracle.residual_error_ulps(r_got, s[idx], r64[idx], residual, DTYPE)
            kw = dict(weight_bias=0.0, dtype_name=DTYPE)
            n = oracle.norm_error_ulps(y, s[idx], y64[idx], inv[idx], residual, gamma, **kw)
            keep_max(worst, {"residual": r, "norm": n})
            worst["shards"] += 1
    return worst


def worker(
    rank,
    world,
    chan,
    *,
    port,
    platform,
    local_devices,
    hosts,
    layouts,
    backends,
    seed,
    device_ids=None,
    run_xla_all_reduces=True,
):
    """Pretends to run on host ``hosts[rank]``, then records per layout and backend what
    happened. ``run_xla_all_reduces=False``: a program with XLA all-reduces is lowered but not
    run ("not_run"): the processes share a GPU, and XLA's NCCL refuses that."""
    from tests.gpu.harness import simulate_host

    simulate_host(hosts[rank])
    ids = device_ids[rank] if device_ids else None
    jax = _setup(rank, world, port, platform, local_devices, ids)
    import jax.numpy as jnp
    import jax_fusedar as jf
    from jax_fusedar.common import native
    from jax_fusedar.ops.dense import FFI_TARGET

    reasons = _Reasons()
    logging.getLogger("jax_fusedar").addHandler(reasons)
    import socket

    out = {"rank": rank, "host": socket.gethostname(), "layouts": {}}
    out["devices"] = [f"{d.id}@{d.process_index}" for d in jax.devices()]
    dtype = jnp.dtype(DTYPE)
    for name in layouts:
        mesh, ws_axes = _mesh(jax, name, world, local_devices)
        if mesh is None:
            out["layouts"][name] = "skipped: not enough devices"
            continue
        res = out["layouts"][name] = {}
        for backend in backends:
            rec = res[backend] = {}
            workspaces = []
            kw = dict(max_token_num=TOKENS, hidden_dim=HIDDEN, dtype=dtype, backend=backend)
            cpu = platform == "cpu"
            make = jf.abstract_workspace if cpu else jf.create_allreduce_fusion_workspace
            try:
                for axis in ws_axes:
                    workspaces.append(make(mesh, axis, **kw))
                    if backend == "auto":  # a second one: its reason is not logged again
                        # (another name: two live kernel workspaces may not share a key)
                        make(mesh, axis, name="second", **kw).destroy()
            except ValueError as e:
                rec["error"] = str(e)
                for ws in workspaces:
                    ws.destroy()
                continue
            rec["backend"] = {ws.axis_name: ws.backend for ws in workspaces}
            members = lambda ws: [list(g.members) for g in ws.groups]
            rec["groups"] = {ws.axis_name: members(ws) for ws in workspaces}
            if any(ws.backend == "trtllm" for ws in workspaces) and not native.available():
                rec["not_lowered"] = "the kernel's custom call needs the native extension"
                continue  # the decision above is still recorded
            fn = _program(jax, jf, mesh, workspaces)
            traced = fn.trace(*_avals(jax, mesh, dtype))
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            rec["custom_calls"] = text.count(f"custom_call @{FFI_TARGET}")
            rec["all_reduces"] = text.count("stablehlo.all_reduce")
            if rec["all_reduces"] and not run_xla_all_reduces:
                why = "XLA's all-reduce between processes sharing a GPU: NCCL refuses"
                rec["not_run"] = why + " two ranks on one GPU"
                for ws in workspaces:
                    ws.destroy()
                continue
            chan.barrier(f"{name}/{backend}/run")
            case_seed = seed + len(out["layouts"])
            rec["worst"] = _check_outputs(jax, mesh, workspaces, fn, dtype, case_seed)
            for ws in workspaces:
                ws.destroy()
            chan.barrier(f"{name}/{backend}/done")
    out["reasons_logged"] = reasons.messages
    jax.distributed.shutdown()
    return out
