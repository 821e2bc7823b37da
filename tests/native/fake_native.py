"""A JAX workspace built over a fake native extension and fake GPU devices (one process, no
GPU): what ``_build_native`` hands every native Rank, and what the workspace reads back."""

import numpy as np

from jax_fusedar.common import native, sizing, tp_groups


class FakeRank:
    """Stands in for native.ext.Rank: records what it was given."""

    made = []

    def __init__(self, device, world, rank, max_tokens, hidden, code, **kw):
        self.kw = dict(device=device, rank=rank, **kw)
        self.timeouts, self.alive, self.record = [kw.get("timeout_s")], True, ""
        FakeRank.made.append(self)

    def local_pointers(self):
        return [1, 2, 3]

    def set_peer_pointers(self, *a):
        pass

    finalize = set_peer_pointers

    def set_timeout(self, t):
        self.timeouts.append(t)

    def failure(self):
        return self.record

    def destroy(self):
        self.alive = False


class _Device:
    def __init__(self, i):
        self.id, self.platform, self.process_index, self.local_hardware_id = i, "gpu", 0, i


class _Mesh:
    devices = np.array([_Device(0), _Device(1)], dtype=object)


def fake_jax_workspace(monkeypatch, workspace_id, **kw):
    """A 2-rank float32 trtllm workspace (16 x 1024) built with ``kw``; its ranks are in
    ``FakeRank.made``."""
    from jax_fusedar import workspace as jws

    class FakeExt:
        Rank = FakeRank
        register_rank = staticmethod(lambda *a: None)

    FakeRank.made = []
    monkeypatch.setattr(native, "require", lambda: FakeExt)
    kw.update(max_token_num=16, hidden_dim=1024, dtype="float32", backend="trtllm")
    sizes = sizing.workspace_sizes(2, 16, 1024, "float32")
    kw.update(groups=[tp_groups.TPGroup((0, 1), 0)], sizes=sizes)
    ws = jws.AllReduceFusionWorkspace(mesh=_Mesh(), axis_name="tp", workspace_id=workspace_id, **kw)
    jws._build_native(ws, 5.0)
    return ws
