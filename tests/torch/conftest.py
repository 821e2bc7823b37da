"""The torch tests need torch: without it (a JAX-only install) the whole folder skips with
the reason, instead of each module skipping itself before its imports."""

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")
pytest.importorskip("torch.distributed", reason="this torch build has no torch.distributed")


@pytest.fixture
def cpu_stream(monkeypatch):
    """The current CUDA stream, without CUDA: a fixed handle the launches record."""
    from torch_compat import cuda_state

    monkeypatch.setattr(cuda_state, "current_stream", lambda device: 0xC0FFEE)


def _gpu_reads_as(major):
    @pytest.fixture
    def fixture(monkeypatch):
        from torch_compat import cuda_state

        monkeypatch.setattr(cuda_state, "compute_capability", lambda device: (major, 0))

    return fixture


sm100, sm90 = _gpu_reads_as(10), _gpu_reads_as(9)  # NVFP4 allowed (Blackwell), refused


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches reset before and after: compiled from scratch, none left."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def handle():
    """The handle of a registered one-member workspace (bfloat16, 64 tokens x 256)."""
    from tests.torch.fakes import fake_workspace, registered

    with registered(fake_workspace(max_tokens=64, hidden=256, global_ranks=(0,))) as h:
        yield h
