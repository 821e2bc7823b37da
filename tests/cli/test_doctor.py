"""``python -m jax_fusedar doctor``: one screen about the machine, without a GPU, torch or the
native build (what a GPU machine shows is checked by tests/gpu/test_demo.py)."""

import json
import types

import pytest

from jax_fusedar.cli import doctor
from jax_fusedar.common import native
from tests.repo import run_code


def _doctor_in_a_subprocess(prelude="", **env):
    code = prelude + (
        "import sys\nfrom jax_fusedar.cli.main import main\ncode = main(['doctor'])\n"
        "print('IMPORTED', sorted(m for m in ('jax', 'jaxlib', 'torch') if m in sys.modules))\n"
        "sys.exit(code)\n"
    )
    return run_code(code, timeout=120, **env)


def test_doctor_prints_one_screen_and_imports_no_framework():
    r = _doctor_in_a_subprocess(JAX_FUSEDAR_STRICT="1", JAX_FUSEDAR_TIMEOUT_S="abc")
    assert r.returncode == 0, r.stderr
    out, imported = r.stdout.rsplit("IMPORTED ", 1)
    assert imported.strip() == "[]"  # versions from the distributions: no jax, no torch
    lines = out.splitlines()
    assert len(lines) <= 40, out  # one terminal screen
    assert lines[0].startswith(("jax_fusedar 0.1.0 (", "jax_fusedar from a source checkout"))
    for head in ("python 3.", "jax: ", "torch: ", "CUDA driver: ", "native build: "):
        assert any(line.startswith(head) for line in lines), (head, out)
    assert "backend 'auto' for a TP group of:" in out
    for world in (2, 4, 8):
        assert f"  {world} ranks: " in out
    # The variables set, with what is wrong with each (a bad value does not stop it).
    assert "  JAX_FUSEDAR_STRICT='1'" in out and "  JAX_FUSEDAR_TIMEOUT_S='abc'" in out
    assert "problem: $JAX_FUSEDAR_TIMEOUT_S='abc' is not a number of seconds" in out
    if native.gpu_count() == 0:
        assert "GPUs: none visible" in out
        assert "  2 ranks: xla (no CUDA GPU for JAX" in out


def test_doctor_without_the_native_build():
    # The extension made unimportable, as in a build without nvcc.
    r = _doctor_in_a_subprocess(f"import sys; sys.modules[{native.MODULE_NAME!r}] = None\n")
    assert r.returncode == 0, r.stderr
    assert "native build: not loaded (" in r.stdout
    assert "JAX_FUSEDAR_BUILD_KERNELS=1 ./dev setup" in r.stdout
    assert "Traceback" not in r.stderr


def test_the_build_record_is_read(tmp_path, monkeypatch):
    assert doctor.build_record(tmp_path) is None
    record = {"cuda_archs": ["90a", "100a"], "nvcc": "13.0.88", "flashinfer_headers": "0.7.2.post1"}
    (tmp_path / doctor.BUILD_RECORD).write_text(json.dumps(record))
    record = doctor.build_record(tmp_path)
    assert record["cuda_archs"] == ["90a", "100a"]
    ext = types.SimpleNamespace(__file__=str(tmp_path / "_fusedar.so"), ABI_VERSION=4)
    monkeypatch.setattr(native, "ext", ext)
    (line,) = doctor._native_lines(record)
    assert line.endswith(
        "CUDA architectures sm_90a, sm_100a; nvcc 13.0.88; FlashInfer headers 0.7.2.post1"
    ), line


# What nvidia-smi prints on a machine with two NVLinked H200s (trimmed), by command line.
SMI = {
    "nvidia-smi": "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |\n",
    "nvidia-smi --query-gpu=index,name,compute_cap,memory.total --format=csv,noheader,nounits": (
        "0, NVIDIA H200, 9.0, 143771\n1, NVIDIA H200, 9.0, 143771\n"
    ),
    "nvidia-smi topo -m": (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV18\t0-47\t0\n"
        "GPU1\tNV18\t X \t0-47\t0\n\nLegend:\n  X    = Self\n"
    ),
}


def smi(cmd):
    return SMI.get(" ".join(cmd))


@pytest.fixture
def two_gpus(monkeypatch):
    peer_ext = types.SimpleNamespace(ABI_VERSION=4, __file__="/x/_fusedar.so")
    peer_ext.can_access_peer, peer_ext.device_count = (lambda i, j: True), (lambda: 2)
    monkeypatch.setattr(native, "ext", peer_ext)
    monkeypatch.setattr(native, "gpu_count", lambda: 2)


def test_a_two_gpu_machine(two_gpus):
    out = "\n".join(doctor.report({"PATH": "/bin"}, smi=smi))
    assert "CUDA driver: 580.159.04 (CUDA 13.0)" in out
    assert "  GPU0: NVIDIA H200, sm 9.0, 143771 MiB" in out
    assert "peer access (the kernel needs it between a TP group's GPUs):" in out
    assert "  GPU0     -    Y\n  GPU1     Y    -" in out
    assert "links (nvidia-smi topo -m; NV# = NVLinks, else a PCIe path):" in out
    assert "  GPU0     X NV18\n  GPU1  NV18    X\n" in out
    assert "  2 ranks: trtllm (the kernel), one GPU per rank (GPUs 0-1)" in out
    assert "  4 ranks: trtllm (the kernel), 4 ranks sharing 2 GPUs: the demo runs one" in out
    assert "JAX_FUSEDAR_* variables: none set" in out
    # auto follows the environment
    for env, line in (
        ({"JAX_FUSEDAR_ALLREDUCE_BACKEND": "xla"}, "xla ($JAX_FUSEDAR_ALLREDUCE_BACKEND)"),
        ({"JAX_PLATFORMS": "cpu"}, "xla (no CUDA GPU"),
        ({"JAX_FUSEDAR_ALLREDUCE_BACKEND": "fast"}, "error: unknown all-reduce backend 'fast'"),
    ):
        assert doctor.auto_backend(2, 2, env).startswith(line)


def test_gpus_without_the_native_build(monkeypatch):
    monkeypatch.setattr(native, "ext", None)
    monkeypatch.setattr(native, "gpu_count", lambda: 0)
    out = "\n".join(doctor.report({}, smi=smi))
    assert "GPUs: 2" in out and "peer access" not in out  # asked through the native module
    assert "  2 ranks: trtllm, but the native build is missing: creating the workspace fails" in out
