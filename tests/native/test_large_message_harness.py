"""The large-message harness (tools/large_message_bench.cu) builds from the product's sources
(the kernels' flags, the patched FlashInfer header, the register counts, the core): a change
that breaks it fails here, not on its next 2-GPU run (docs/large_messages.md)."""

import os
import shutil
import subprocess

import pytest

from tests.native.host_program import build_tree
from tests.skips import BUILD_NATIVE


@pytest.mark.slow
def test_the_harness_builds_against_the_core():
    build = build_tree("ffi/core/libfusedar_core.so")
    if build is None:
        pytest.skip(f"needs a build tree with the kernels ({BUILD_NATIVE})")
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not on PATH")
    cmd = ["cmake", "--build", str(build), "--target", "large_message_bench"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    harness = build / "ffi" / "core" / "large_message_bench"
    assert harness.is_file() and os.access(harness, os.X_OK)
