import os

import pytest


# docs/testing.md says what each marker is for and which lane runs it.
MARKERS = {
    "gpu": "needs NVIDIA GPUs and the native module (tools/gpu_check.sh and python -m "
    "tests.gpu.run_lane run them)",
    "slow": "takes more than about 5 s on 2 cores; ./dev test --quick and the GPU quick lane "
    "leave it out",
    "sweep": "an exhaustive sweep, left out of every lane unless asked for (pytest -m sweep)",
    "oldest": "also runs on the oldest JAX and torch supported (./dev oldest)",
    "integration": "jax_fusedar.fuse on models of MaxText, transformers, Flax and Equinox, in "
    "the lane's own venv; left out unless asked for (tools/integration.sh)",
}


def pytest_configure(config):
    for marker, what in MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: {what}")


def gpu_count() -> int:
    from jax_fusedar.common import native

    return native.gpu_count()


def pytest_collection_modifyitems(config, items):
    markexpr = config.option.markexpr or ""
    reasons = {  # marker -> why its tests skip here
        "sweep": "an exhaustive sweep: run it with pytest -m sweep",
        "integration": "the integration lane needs its own venv: run it with tools/integration.sh",
    }
    reasons = {marker: why for marker, why in reasons.items() if marker not in markexpr}
    if gpu_count() == 0:
        reasons["gpu"] = (
            "no CUDA GPU visible (tools/gpu_check.sh runs the GPU tests on a machine with GPUs)"
        )
    # The marker, not item.keywords: keywords also hold the folder names, so every test
    # under tests/gpu/ would match "gpu", CPU dry runs of the GPU workers included.
    skips = {marker: pytest.mark.skip(reason=reason) for marker, reason in reasons.items()}
    for item in items:
        for marker, skip in skips.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


@pytest.fixture
def gloo_world1():
    """A one-rank torch.distributed world over gloo (an in-memory store), torn down after the
    test: its WORLD group. torch is imported here, so JAX-only runs never need it."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


# Never let any process we start use NVLink multicast (docs/decisions.md: it can take a
# shared host's GPUs down). Set here so every subprocess inherits it.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


@pytest.fixture
def hermetic(monkeypatch):
    """No strict mode, backend choice or handshake leaking in from the environment, and
    fallback warnings neither hidden by earlier tests nor hiding later ones (each kind logs
    once). Imported lazily: tests/jax/conftest.py sets XLA_FLAGS before JAX is first imported."""
    from jax_fusedar.ops import plan as ops_plan
    from jax_fusedar.common import backend_choice, handshake

    for var in (
        backend_choice.STRICT_ENV_VAR,
        backend_choice.BACKEND_ENV_VAR,
        handshake.HANDSHAKE_ENV_VAR,
        *handshake.EARLIER_ENV_VARS,  # still read where the new names are unset
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ops_plan, "_fallback_reasons_logged", set())
