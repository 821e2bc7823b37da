"""The large-message harness (tools/large_message_bench.cu) builds from the product's sources:
the build tree's target compiles it with the kernels' flags, the patched FlashInfer header and
the generated register counts, and links the core. Built here so that a change of the
kernels' sources or of the C API that breaks it fails a test here, not its next run on a
GPU machine (it runs on 2 GPUs only: docs/large_messages.md)."""

import os
import pathlib
import shutil
import subprocess

import pytest

from tests.repo import REPO
from tests.skips import BUILD_NATIVE


def _build_dir():
    """The build tree with the kernels: $JAX_FUSEDAR_BUILD_DIR, else build/dev (./dev)."""
    for c in (os.environ.get("JAX_FUSEDAR_BUILD_DIR"), REPO / "build" / "dev"):
        if c and (pathlib.Path(c) / "ffi" / "core" / "libfusedar_core.so").exists():
            return pathlib.Path(c)
    return None


@pytest.mark.slow
def test_the_harness_builds_against_the_core():
    build = _build_dir()
    if build is None:
        pytest.skip(f"needs a build tree with the kernels ({BUILD_NATIVE})")
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not on PATH")
    r = subprocess.run(
        ["cmake", "--build", str(build), "--target", "large_message_bench"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    harness = build / "ffi" / "core" / "large_message_bench"
    assert harness.is_file() and os.access(harness, os.X_OK)
