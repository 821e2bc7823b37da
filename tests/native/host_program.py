"""Compiles a small host C++ program against the core's handshake and status sources with nvcc
and runs it: how the native tests read the core's failure texts without a GPU. The program
prints ``name=[text]`` lines; returns them as a dict. Skips without nvcc."""

import os
import pathlib
import shutil
import subprocess

import pytest

from tests.repo import REPO


def nvcc():
    default = "/usr/local/cuda/bin/nvcc"
    return shutil.which("nvcc") or (default if os.path.exists(default) else None)


def build_tree(holding: str):
    """The build tree with the kernels, $JAX_FUSEDAR_BUILD_DIR else build/dev (./dev), where
    it has a file matching the glob ``holding``; None without one."""
    for c in (os.environ.get("JAX_FUSEDAR_BUILD_DIR"), REPO / "build" / "dev"):
        if c and any(pathlib.Path(c).glob(holding)):
            return pathlib.Path(c)
    return None


def run_host_program(tmp_path, name: str, source: str) -> dict:
    compiler = nvcc()
    if compiler is None:
        pytest.skip("nvcc not found")
    src, exe, core = tmp_path / f"{name}.cu", tmp_path / name, REPO / "ffi" / "core"
    src.write_text(source)
    cmd = [compiler, "-std=c++17", "-arch=sm_90a", f"-I{core}", f"-I{core / 'include'}", str(src)]
    cmd += [str(core / "handshake.cu"), str(core / "status.cpp"), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return dict(line.split("=", 1) for line in run.stdout.splitlines())
