"""The build rule (ffi/cmake/build_plan.py) that ``pip install`` (through CMake) and ./dev
share: whether the CUDA kernels are compiled, for which architectures, and the announcement
before a long build. ./dev's side: tests/test_install.py (``./dev build-plan``)."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.native.host_program import nvcc
from tests.repo import REPO

sys.path.insert(0, str(REPO / "ffi" / "cmake"))
import build_plan  # noqa: E402


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(build_plan, "visible_gpu_archs", lambda: [])


def test_the_default_builds_only_where_a_gpu_is_visible(no_gpu, monkeypatch):
    assert build_plan.plan({}) == (False, [], "no GPU visible", False)
    monkeypatch.setattr(build_plan, "visible_gpu_archs", lambda: ["90a"])
    assert build_plan.plan({}) == (True, ["90a"], "GPU visible (90a)", False)
    assert build_plan.plan({"JAX_FUSEDAR_CUDA_ARCHS": "100a"})[1] == ["100a"]


def test_asked_for_or_forbidden(no_gpu):
    want = (True, ["90a", "100a"], "JAX_FUSEDAR_BUILD_KERNELS=1", True)
    assert build_plan.plan({"JAX_FUSEDAR_BUILD_KERNELS": "ON"}) == want
    assert build_plan.plan({"JAX_FUSEDAR_BUILD_KERNELS": "0"})[0] is False
    assert build_plan.plan({"JAX_FUSEDAR_REQUIRE_CUDA": "1"})[:2] == (True, ["90a", "100a"])
    # CMake's -D wins over the environment.
    assert build_plan.plan({"JAX_FUSEDAR_BUILD_KERNELS": "1"}, build_kernels="off")[0] is False
    assert build_plan.plan({}, build_kernels="1", archs="90a,100a")[1] == ["90a", "100a"]
    with pytest.raises(ValueError, match="JAX_FUSEDAR_BUILD_KERNELS must be"):
        build_plan.plan({"JAX_FUSEDAR_BUILD_KERNELS": "maybe"})
    with pytest.raises(ValueError, match="REQUIRE_CUDA=1 asks for the kernels and"):
        build_plan.plan({"JAX_FUSEDAR_BUILD_KERNELS": "0", "JAX_FUSEDAR_REQUIRE_CUDA": "1"})


def test_a_build_tree_that_built_them_keeps_them_in_step(no_gpu):
    want = (True, [], "built in this build tree before", False)
    assert build_plan.plan({}, previous=True) == want
    assert build_plan.plan({"JAX_FUSEDAR_BUILD_KERNELS": "0"}, previous=True)[0] is False


def test_the_announcement_says_what_for_which_archs_how_long_and_how_to_skip():
    text = build_plan.announcement(["90a", "100a"], "JAX_FUSEDAR_BUILD_KERNELS=1", cores=2)
    assert text.startswith(
        "jax_fusedar: compiling the CUDA kernels (JAX_FUSEDAR_BUILD_KERNELS=1) for sm_90a, "
        "sm_100a: about 10 min with 2 cores (10 CPU-minutes per architecture)."
    ), text
    assert "JAX_FUSEDAR_BUILD_KERNELS=0 skips them" in text
    assert "JAX_FUSEDAR_CUDA_ARCHS=90a builds one architecture" in text
    assert "about 3 min with 8 cores" in build_plan.announcement(["90a", "100a"], "x", cores=8)
    assert ";" not in text  # CMake reads the plan as a list


def _configure(tmp_path, **env_vars):
    """CMake's configure of a fresh build tree with no CUDA compiler and no GPU in reach."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_FUSEDAR_")}
    # A CUDA compiler that is not there (CMake would otherwise find /usr/local/cuda's).
    env.update({"PATH": "/usr/bin:/bin", "CUDACXX": "/nonexistent/nvcc", **env_vars})
    cmd = [shutil.which("cmake"), "-S", str(REPO), "-B", str(tmp_path / "build")]
    return subprocess.run(
        [*cmd, f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )


needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


@pytest.fixture
def no_visible_gpu():
    if shutil.which("nvidia-smi", path="/usr/bin:/bin"):
        pytest.skip("a GPU is visible here: the default builds the kernels")


@needs_cmake
@pytest.mark.parametrize(
    "cudacxx",
    [None, pytest.param("nvcc", marks=pytest.mark.skipif(nvcc() is None, reason="no nvcc here"))],
    ids=["no_cuda_compiler", "nvcc"],
)
def test_cmake_skips_the_kernels_without_a_gpu(tmp_path, no_visible_gpu, cudacxx):
    """With nvcc, the case pip met: before, the configure went on to the kernels (52 minutes
    of compiling behind pip's spinner); now it stops at the plan."""
    r = _configure(tmp_path, **({"CUDACXX": nvcc()} if cudacxx else {}))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "jax_fusedar: not building the CUDA kernels (no GPU visible)" in r.stdout, r.stdout
    assert not (tmp_path / "build" / "ffi" / "core").exists()  # the kernels were not set up


@needs_cmake
def test_cmake_honours_build_kernels_from_the_environment(tmp_path):
    # Asked for, with no CUDA compiler: an error saying so, not a silent reference build.
    r = _configure(tmp_path, JAX_FUSEDAR_BUILD_KERNELS="1")
    assert r.returncode != 0
    assert "the CUDA kernels are asked for (JAX_FUSEDAR_BUILD_KERNELS=1)" in r.stderr, r.stderr
    r = _configure(tmp_path / "bad", JAX_FUSEDAR_BUILD_KERNELS="maybe")
    assert r.returncode != 0 and "JAX_FUSEDAR_BUILD_KERNELS must be" in r.stderr, r.stderr
