"""``sizing.workspace_bytes``: one rank's workspace memory, the same number for every way of
naming the dtype and for both frameworks, and the ``bytes_per_rank`` every workspace's repr
shows (``lifecycle``)."""

import importlib.util

import numpy as np
import pytest

from jax_fusedar.common import lifecycle, sizing


def test_workspace_bytes_is_the_per_rank_size():
    # 8192 x 8192 bf16 at TP 8: two-shot 1 GiB + 3 Lamport sub-buffers of 1 GiB, the flags
    # (8 ranks x 256 x int32) and the 5-int control block.
    n = sizing.workspace_bytes(8, 8192, 8192, "bfloat16")
    assert n == 4 * 2**30 + 8 * 256 * 4 + 5 * 4
    assert n == sizing.workspace_sizes(8, 8192, 8192, "bfloat16").per_rank_bytes
    assert sizing.format_bytes(n) == "4.00 GiB"
    # float32 doubles the buffers; the Lamport stride stops at MAX_COMM_SIZE.
    assert sizing.workspace_bytes(2, 16, 4096, "float32") == (
        2 * 16 * 4096 * 4 * 4 + 2 * 256 * 4 + 20
    )
    big = sizing.workspace_sizes(16, 8192, 8192, "float32")
    assert big.lamport_comm_bytes == sizing.MAX_COMM_SIZE


@pytest.mark.parametrize("dtype", ["bfloat16", np.float16, np.dtype("float32")])
def test_workspace_bytes_takes_names_and_numpy_dtypes(dtype):
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    assert sizing.workspace_bytes(4, 64, 1024, dtype) == sizing.workspace_bytes(4, 64, 1024, name)


def test_workspace_bytes_takes_jax_and_torch_dtypes_alike():
    want = sizing.workspace_bytes(2, 128, 4096, "bfloat16")
    if importlib.util.find_spec("jax"):
        import jax.numpy as jnp

        import jax_fusedar

        assert jax_fusedar.workspace_bytes(2, 128, 4096, jnp.bfloat16) == want
    if importlib.util.find_spec("torch"):
        import torch

        import torch_compat

        assert torch_compat.workspace_bytes(2, 128, 4096, torch.bfloat16) == want
        assert torch_compat.workspace_bytes is sizing.workspace_bytes


def test_workspace_bytes_refuses_what_the_kernel_does_not_run():
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        sizing.workspace_bytes(2, 16, 4096, "int8")
    with pytest.raises(ValueError, match="world size 3 is not supported"):
        sizing.workspace_bytes(3, 16, 4096, "bfloat16")


@pytest.mark.parametrize(
    "n, text", [(0, "0 B"), (512, "512 B"), (3 << 20, "3.00 MiB"), (12 << 20, "12.0 MiB")]
)
def test_format_bytes(n, text):
    assert sizing.format_bytes(n) == text


class _Workspace(lifecycle.WorkspaceLifecycle):
    def __init__(self, backend):
        self.backend = backend
        self.sizes = sizing.workspace_sizes(8, 8192, 8192, "bfloat16")

    def _repr_fields(self):
        return [f"backend={self.backend!r}"]

    def _release(self):
        pass


def test_the_shared_repr_shows_bytes_per_rank():
    ws = _Workspace("trtllm")
    assert ws.bytes_per_rank == sizing.workspace_bytes(8, 8192, 8192, "bfloat16")
    assert (
        repr(ws) == f"_Workspace(backend='trtllm', bytes_per_rank={ws.bytes_per_rank} (4.00 GiB))"
    )
    ws.destroy()
    assert repr(ws).endswith(" (4.00 GiB), destroyed)")
    # XLA's collectives allocate nothing.
    assert repr(_Workspace("xla")) == "_Workspace(backend='xla', bytes_per_rank=0)"
