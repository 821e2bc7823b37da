"""The stand-ins check_vllm.py and check_sglang.py share in the framework venv (venv.py):
importing them runs nothing, so pytest may collect the scripts."""

import logging

import torch
import torch.distributed as dist

import torch_compat
from torch_compat import cuda_state


def setup():
    """(the shim's flashinfer.comm, the one-rank gloo WORLD group)."""
    comm = torch_compat.install_as_flashinfer()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cuda_state.current_stream = lambda device: 0xC0FFEE
    return comm, dist.group.WORLD


def recorded(logger):
    """The list of every message ``logger`` logs from now on."""
    records = []
    keep = logging.Handler()
    keep.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(keep)
    return records


def served_inputs():
    """(a 2-rank workspace over a recording FakeRank, (x, residual, gamma) of 16 tokens)."""
    from tests.torch import rounding_check as rc
    from tests.torch.fakes import fake_workspace

    ws = fake_workspace(world=2, max_tokens=64, hidden=1024)
    return ws, rc.inputs(16, 1024, torch.bfloat16, seed=0)


def served(call, ws, x, flags):
    """The last launch on ``ws`` after ``call()`` (which returns {key: (launch argument,
    tensor)}): whether each such argument is its tensor, the ``flags`` arguments; or the error."""
    try:
        pointers = call()
        args, kw = ws._rank_obj.launches[-1]
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}"}
    out = dict(launches=len(ws._rank_obj.launches), pattern=args[0], tokens=args[2])
    out.update(hidden=args[3], input_is_x=args[4] == x.data_ptr())
    out.update({key: kw[name] == t.data_ptr() for key, (name, t) in pointers.items()})
    return out | {f: kw[f] for f in flags}
