"""GPU body of the "mixed" topology: world size 4 over 2 processes, each driving BOTH GPUs as
two TP ranks, connected by jax_fusedar.common.exchange (Member(process, device)):

    TP rank 0: process 0, GPU 0      TP rank 2: process 1, GPU 0
    TP rank 1: process 0, GPU 1      TP rank 3: process 1, GPU 1

Peers in the same process are reached by raw peer pointers, the others by CUDA IPC (two on
the same GPU in another process: their kernels time-slice); the handles travel over a torch
TCPStore through torch_compat's StoreChannel. Two workspaces, handshake off and on: on each,
one- and two-shot pattern-1 calls against the float64 oracle (NaN-poisoned outputs, fresh
inputs; all four ranks must agree bitwise). Then both are destroyed and each GPU's free
memory must come back.

Run by hand:  python -m tests.gpu.workers.native_mixed      (last stdout line: "RESULT <json>")
"""

import datetime
import hashlib
import time

from tests.gpu.workers.common import new_seed, print_result

HIDDEN = 4096
MAX_TOKENS = 1024  # ~128 MiB per rank, so the memory check sees the workspaces come and go
CALLS = [(16, True), (33, True), (1, True), (16, False), (33, False), (200, False)]
WORLD = 4
MIB = 1 << 20


def _mem(ext):
    return {d: int(ext.mem_info(d)[0]) for d in (0, 1)}


def worker(proc, nprocs, chan, *, port, seed):
    import torch
    import torch.distributed as dist
    from jax_fusedar.common import exchange, native, tp_groups
    from tests.gpu.workers.native_mismatch import draw_inputs, flush_c_stdio, fused_call
    from tests.gpu.workers.native_mismatch import new_outputs, oracle_errors, worst_of
    from torch_compat.channel import StoreChannel

    ext = native.require()
    assert torch.cuda.device_count() >= 2, "needs 2 GPUs"
    for d in (0, 1):  # contexts on both GPUs before the first memory reading
        torch.zeros(1, device=d)
        torch.cuda.synchronize(d)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, nprocs, proc == 0, timeout=timeout)
    kv = StoreChannel(store, timeout_s=60.0, process=proc)
    members = [exchange.Member(p, d) for p in (0, 1) for d in (0, 1)]  # (process, device)
    group = tp_groups.TPGroup((0, 1, 2, 3), 0)
    code = native.DTYPE_CODES["bfloat16"]
    result = {"process": proc, "gpus": [torch.cuda.get_device_name(d) for d in (0, 1)]}

    chan.barrier("before-create")
    free_before = _mem(ext)
    result["free_before_mib"] = {d: v / MIB for d, v in free_before.items()}
    # Free memory is per GPU, and both processes allocate on both GPUs: no process may
    # allocate before every process has taken its reading (seen on 2 x H200: a process that
    # read late saw part of its peer's workspace already allocated).
    chan.barrier("measured-before")

    workspaces = {}
    for serial, check in ((1, False), (2, True)):

        def make_rank(device, tp_rank, check=check):
            kw = dict(handshake=check, handshake_timeout_s=60.0)
            return ext.Rank(device, WORLD, tp_rank, MAX_TOKENS, HIDDEN, code, **kw)

        names = dict(namespace="mixed_test", serial=serial)
        plan = exchange.create_and_publish(group, members, proc, make_rank, kv, **names)
        exchange.connect_and_finalize(plan, proc, kv, **names)
        workspaces[check] = plan.local  # {tp_rank: Rank}
    result["local_tp_ranks"] = sorted(workspaces[False])
    path = lambda m: "pointers" if m.process == proc else "ipc"
    peers = lambda tp: {str(p): path(m) for p, m in enumerate(members) if p != tp}
    result["paths"] = {str(tp): peers(tp) for tp in workspaces[False]}
    chan.barrier("created")
    free_mid = _mem(ext)
    chan.barrier("measured-mid")  # the calls below allocate inputs through torch
    info = next(iter(workspaces[False].values())).info()
    per_rank = info["two_shot_buffer_bytes"] + info["flag_bytes"] + info["lamport_buffer_bytes"]
    result["workspace_bytes_per_rank"] = per_rank
    # Two workspaces x two ranks (one per process) on each GPU.
    result["drop_mib"] = {d: (free_before[d] - free_mid[d]) / MIB for d in (0, 1)}
    result["expected_drop_mib"] = 4 * per_rank / MIB

    streams = {d: torch.cuda.current_stream(d) for d in (0, 1)}
    calls = {}
    for check, ranks in workspaces.items():
        errs, digests = [], []
        for i, (m, oneshot) in enumerate(CALLS):
            xs, residual, gamma = draw_inputs(seed + 17 * i + int(check), WORLD, m, HIDDEN, torch)
            launched = {}
            for tp, ws in ranks.items():
                d = members[tp].device
                with torch.cuda.device(d):
                    x, res, gam = (t.cuda(d) for t in (xs[tp], residual, gamma))
                    outs = new_outputs(x, torch)
                    fused_call(ws, 1, m, x, res, gam, outs, oneshot=oneshot, stream=streams[d])
                launched[tp] = (x, res, gam, outs)
            for d in (0, 1):
                streams[d].synchronize()
            local = {}  # every rank must hold the same bits (compared across processes)
            for tp, (_, _, _, outs) in sorted(launched.items()):
                e = oracle_errors(xs, residual, gamma, outs, 1)
                e.update(tp_rank=tp, tokens=m, oneshot=oneshot)
                errs.append(e)
                h = hashlib.sha256()
                for k in ("residual", "norm"):
                    h.update(outs[k].cpu().view(torch.uint8).numpy().tobytes())
                local[str(tp)] = h.hexdigest()
            digests.append(local)
            del launched, x, res, gam, outs
        worst = worst_of([{k: e[k] for k in ("residual", "norm")} for e in errs])
        calls["on" if check else "off"] = {"worst": worst, "per_call": errs, "digests": digests}
    result["calls"] = calls
    result["failure_records"] = [ws.failure() for ws in workspaces[True].values()]
    flush_c_stdio()

    chan.barrier("before-destroy")  # no rank may still be in a call when a peer frees
    for ranks in workspaces.values():
        for ws in ranks.values():
            ws.destroy()
    for d in (0, 1):
        torch.cuda.synchronize(d)
    torch.cuda.empty_cache()
    chan.barrier("destroyed")
    time.sleep(0.5)
    free_after = _mem(ext)
    result["free_after_mib"] = {d: v / MIB for d, v in free_after.items()}
    result["returned_mib"] = {d: (free_after[d] - free_mid[d]) / MIB for d in (0, 1)}
    result["leak_mib"] = {d: (free_before[d] - free_after[d]) / MIB for d in (0, 1)}
    chan.barrier("measured")
    return result


def main():
    from tests.gpu.harness import free_port, run_ranks

    seed = new_seed()
    run = lambda: run_ranks(worker, 2, timeout_s=150, port=free_port(), seed=seed)
    print_result({"seed": seed}, "processes", run)


if __name__ == "__main__":
    main()
