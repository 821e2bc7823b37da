"""What the GPU workers share: the ``RESULT <json>`` line of a module a test starts as
``python -m tests.gpu.workers.<name>`` (tests/gpu/case_runs.py reads it), the text of a call
expected to fail, a fresh seed, and a rank's gloo process group."""

import json
import os
import sys
import time

# What every rank process must see (tests/conftest.py sets it under pytest; a worker started
# by hand sets it itself).
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def no_multicast_defaults():
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)


def new_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def error_text(call, limit):
    """None if ``call()`` returns, else its exception as "Type: message", cut to ``limit``."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the outcome under test
        return f"{type(e).__name__}: {e}"[:limit]
    return None


def print_result(head: dict, key: str, run) -> None:
    """Prints the last stdout line, ``RESULT <json>``: ``head`` with ``key`` holding
    ``run()``, or, where ``run`` raises, head's case and seed with the error's last 6,000
    characters; then the run's wall time (``wall_s``)."""
    t0 = time.monotonic()
    try:
        out = {**head, key: run()}
    except Exception as e:  # noqa: BLE001 - reported as JSON for the test to show
        out = {k: v for k, v in head.items() if k in ("case", "seed")}
        out["error"] = str(e)[-6000:]
    out["wall_s"] = time.monotonic() - t0
    sys.stdout.flush()
    print("RESULT " + json.dumps(out), flush=True)


def case_of(argv, cases, default, *, any_world=None):
    """(case, world) from ``python -m ... CASE [WORLD]``; SystemExit for an unknown case, or
    a world other than 2 for a case that ``any_world(case)`` does not allow."""
    case = argv[1] if len(argv) > 1 else default
    world = int(argv[2]) if len(argv) > 2 else 2
    if case not in cases:
        raise SystemExit(f"unknown case {case!r}; one of {tuple(cases)}")
    if world != 2 and not any_world(case):
        raise SystemExit(f"case {case!r} runs with 2 ranks")
    return case, world


def init_gloo(rank, world, port, device):
    """This process on GPU ``device``, in a gloo process group of ``world`` ranks on
    localhost:``port``; returns (torch, torch.distributed)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    return torch, dist


def connect_ipc(ws, chan, rank, tag):
    """Exchanges the ranks' CUDA IPC handles of ``ws`` over ``chan`` (as ``tag``), opens the
    peers' and finalizes ``ws``."""
    for peer, h in enumerate(chan.all_gather(tag, ws.export_ipc())):
        if peer != rank:
            ws.open_peer_ipc(peer, h)
    ws.finalize()


def plain_ulps(xs, residual, gamma, dtype, *, residual_out, norm_out, allreduce_out=None, wb=0.0):
    """Errors in ulps (tests/oracles/oracle.py) of a pattern-1 call's residual_out and
    norm_out, and of a pattern-0 allreduce_out where given, against the float64 oracle of
    every rank's partial sums ``xs``, ``residual`` and ``gamma`` (rms_eps 1e-6)."""
    from tests.oracles import oracle

    s, r, y, inv = oracle.fused_reference(xs, residual, gamma, rms_eps=1e-6, weight_bias=wb)
    out = {
        "residual": oracle.residual_error_ulps(residual_out, s, r, residual, dtype),
        "norm": oracle.norm_error_ulps(
            norm_out, s, y, inv, residual, gamma, weight_bias=wb, dtype_name=dtype
        ),
    }
    if allreduce_out is not None:
        out["allreduce"] = oracle.allreduce_error_ulps(allreduce_out, s, dtype)
    return out


def scale_ulps(got, want):
    """The largest distance of dynamic FP8 scales ``got`` from the oracle's ``want``, in fp32
    ulps of ``want``."""
    import numpy as np

    ulp32 = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return float(np.max(np.abs(got.astype(np.float64) - want) / ulp32))


def counters(ints="", floats="", **more):
    """A stats dict: 0 for each name in ``ints``, 0.0 for each in ``floats`` (names split on
    spaces), then ``more``."""
    return {**dict.fromkeys(ints.split(), 0), **dict.fromkeys(floats.split(), 0.0), **more}


def keep_max(into, errors):
    """``into[k] = max(into[k], v)`` for every error (Python's max: a NaN error keeps the
    number held; the workers that use this count NaN outputs apart)."""
    for k, v in errors.items():
        into[k] = max(into[k], v)
    return into


def jit_shard_map(jax, body, mesh, in_specs, out_specs):
    """``jax.jit(jax.shard_map(body, ...))``: the program form every JAX worker runs."""
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def jax_workspace(jf, mesh, tokens, hidden, dtype, **kw):
    """``jf.create_allreduce_fusion_workspace`` over the "tp" axis of ``mesh``."""
    return jf.create_allreduce_fusion_workspace(
        mesh, "tp", max_token_num=tokens, hidden_dim=hidden, dtype=dtype, **kw
    )


def jax_distributed(rank, world, port, platform, device_ids=None, **kw):
    """Imports jax and joins this rank's `jax.distributed` group over localhost:``port``: on
    CPU with gloo collectives across the processes, on GPUs driving ``device_ids``."""
    import jax

    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=world,
        process_id=rank,
        local_device_ids=None if platform == "cpu" else device_ids,
        **kw,
    )
    return jax


def anchor_workspace(fi, dist, world, rank, max_tokens, hidden, dtype):
    """FlashInfer's own workspace (tests/gpu/anchor.py's build ``fi``) over the whole process
    group of ``dist``."""
    from tests.gpu import anchor

    return anchor.create_workspace(
        fi,
        world_size=world,
        rank=rank,
        max_token_num=max_tokens,
        hidden_dim=hidden,
        dtype=dtype,
        group=dist.group.WORLD,
    )
