"""torch_compat without a GPU: ``FakeRank`` records the exchange and every launch (dense and
MoE) for the native Rank, and ``fake_workspace`` is a real ``TorchAllReduceFusionWorkspace``
over it on the CPU (fixtures on them: tests/torch/conftest.py)."""

import contextlib

import pytest
import torch

import torch_compat
from jax_fusedar.common import sizing
from torch_compat import workspace as wsmod

AR = torch.ops.torch_compat.allreduce.default
FUSED = torch.ops.torch_compat.allreduce_residual_rmsnorm.default
QUANT = torch.ops.torch_compat.allreduce_residual_rmsnorm_quant.default


class FakeRank:
    def __init__(self, process=0, device=0, tp_rank=0):
        self.process, self.device, self.tp_rank = process, device, tp_rank
        self.peers, self.finalized, self.launches, self.destroyed = {}, False, [], 0
        self.moe_launches = []

    def export_ipc(self):
        return f"ipc:{self.process}:{self.device}:{self.tp_rank}".encode()

    def local_pointers(self):
        return [1, 2, 3]

    def set_peer_pointers(self, peer, peer_device, ptrs):
        self.peers[peer] = ("ptr", peer_device)

    def open_peer_ipc(self, peer, handles):
        self.peers[peer] = ("ipc", handles.decode())

    def finalize(self):
        self.finalized = True

    def launch(self, *args, **kw):
        self.launches.append((args, kw))

    def moe_launch(self, *args, **kw):
        self.moe_launches.append((args, kw))

    def failure(self):
        return ""

    def destroy(self):
        self.destroyed += 1


def fake_workspace(world=2, max_tokens=128, hidden=1024, dtype=torch.bfloat16, global_ranks=None):
    """A workspace of ``world`` ranks (rank 0, on "cpu" for CPU tensors) over a FakeRank;
    ``global_ranks``: the members, when not 0..world-1 (one member keeps the sizes of 2
    ranks: the kernel has no 1-rank build, and only the buffer rule matters then)."""
    ranks = list(range(world) if global_ranks is None else global_ranks)
    sizes = sizing.workspace_sizes(max(2, len(ranks)), max_tokens, hidden, wsmod.dtype_name(dtype))
    kw = dict(native_rank=FakeRank(), global_ranks=ranks, rank=0, device=0, dtype=dtype)
    kw.update(max_token_num=max_tokens, hidden_dim=hidden, sizes=sizes)
    ws = wsmod.TorchAllReduceFusionWorkspace(**kw)
    ws.torch_device = torch.device("cpu")
    return ws


@contextlib.contextmanager
def registered(ws):
    """The handle of ``ws`` in torch_compat's registry, unregistered afterwards."""
    from torch_compat import library

    h = library.register_workspace(ws)
    try:
        yield h
    finally:
        library.unregister_workspace(h)


def fuse(ws, pattern, **kw):
    """torch_compat.allreduce_fusion on ``ws``, every argument by keyword."""
    return torch_compat.allreduce_fusion(workspace=ws, pattern=pattern, **kw)


def refused(ws, pattern, match, error=ValueError, **kw):
    """``fuse`` raises ``error`` matching ``match`` before launching anything (dense or MoE)."""
    rank = ws.native_rank()
    before = len(rank.launches), len(rank.moe_launches)
    with pytest.raises(error, match=match):
        fuse(ws, pattern, **kw)
    assert (len(rank.launches), len(rank.moe_launches)) == before


def last_launch(ws):
    """(args, kw) of the last dense launch on ``ws``."""
    return ws.native_rank().launches[-1]
