"""The bounded waits must not change FlashInfer's launch geometry.

FlashInfer's launcher sizes blocks and clusters from the kernel's register count; the hooked
kernels use a few more registers, so the build pins the geometry to the unhooked kernels'
counts (ffi/kernels/launch_registers.cuh). tools/launch_registers.py check verifies a built
library against its build tree: every kernel (pattern, dtype, world size, accumulation,
one-shot and two-shot, every architecture) is launched as its unhooked twin and fits.
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from tests.repo import REPO
from tests.skips import BUILD_NATIVE

TOOL = REPO / "tools" / "launch_registers.py"
_spec = importlib.util.spec_from_file_location("launch_registers", TOOL)
launch_registers = importlib.util.module_from_spec(_spec)
sys.modules["launch_registers"] = launch_registers
_spec.loader.exec_module(launch_registers)


def test_mangled_kernel_names_name_their_instance():
    one = (
        "_ZN10flashinfer23trtllm_allreduce_fusion39allreduce_fusion_kernel_oneshot_lamportI"
        "LNS0_22AllReduceFusionPatternE11E13__nv_bfloat16Li8ELb1ELb0EEEvNS0_21AllReduce"
        "FusionParamsIT0_EE"
    )
    two = (
        "_ZN10flashinfer23trtllm_allreduce_fusion36allreduce_fusion_kernel_twoshot_syncILNS0_"
        "22AllReduceFusionPatternE0EfLi16ELb0EEEvNS0_21AllReduceFusionParamsIT0_EESt5arrayIiXT1"
        "_EES7_"
    )
    K = launch_registers.Kernel
    assert launch_registers.parse_kernel(one) == K(0, 11, 2, 8, True)
    assert launch_registers.parse_kernel(two) == K(2, 0, 0, 16, False)
    assert launch_registers.parse_kernel("_ZN7fusedar18fill_negative_zeroEP5uint4lj") is None


def test_geometry_reproduces_the_parity_break_the_pin_prevents():
    # 1024 x 8192 bf16 two-shot on 2 ranks: the unhooked kernel (64 registers) runs 1024-thread
    # blocks without clusters; the hooked one (72 registers) would run 512 threads x cluster 2,
    # which reorders RMSNorm's reduction (340 differing bytes against FlashInfer's build).
    shape = dict(hidden_dim=8192, tokens=1024, elem_bytes=2, nranks=2, oneshot=False)
    assert launch_registers.flashinfer_geometry(64, **shape) == (1024, 1)
    assert launch_registers.flashinfer_geometry(72, **shape) == (512, 2)
    # Every count up to 64 is one bucket there; above it, single registers matter (7168).
    assert {launch_registers.flashinfer_geometry(r, **shape) for r in range(24, 65)} == {(1024, 1)}
    s7168 = dict(shape, hidden_dim=7168)
    assert launch_registers.flashinfer_geometry(
        72, **s7168
    ) != launch_registers.flashinfer_geometry(74, **s7168)


def test_header_round_trip_keeps_every_count():
    K = launch_registers.Kernel
    table = {
        K(kind, p, 1, 4, acc): 30 + kind + p + acc
        for kind in range(3)
        for p in (0, 1, 11)
        for acc in (0, 1)
    }
    text = launch_registers.header_text(
        1, 4, {90: table, 100: {k: r + 1 for k, r in table.items()}}
    )
    assert "kArchs[kNumArchs] = {90, 100}" in text
    assert "{41, 42}, {0, 0}" in text  # pattern 11 (then 12: none), one-shot, sm_90
    with pytest.raises(ValueError, match="does not belong"):
        launch_registers.header_text(2, 4, {90: table})


def test_moe_kernel_names_and_their_table():
    """The MoE kernels (patterns 6, 7): parsed from their mangled names, their bool template
    flags as the index moe_launch_registers.cuh computes (first flag highest)."""
    reduction = (
        "_ZN10flashinfer27trtllm_moe_allreduce_fusion49moereduce_allreduce_fusion_kernel"
        "_oneshot_lamportI13__nv_bfloat16Li2ELb1ELb0ELb1ELb0EEEvNS0_33MoeReductionAll"
        "ReduceFusionParamsIT_EE"
    )
    finalize = (
        "_ZN10flashinfer27trtllm_moe_allreduce_fusion51moefinalize_allreduce_fusion_kernel"
        "_oneshot_lamportI6__halfLi16ELb1ELb1ELb0ES2_EEvNS0_32MoeFinalizeAllReduceFusion"
        "ParamsIT_EE"
    )
    M = launch_registers.MoeKernel
    assert launch_registers.parse_moe_kernel(reduction) == M(0, 2, 2, 0b1010)
    assert launch_registers.parse_moe_kernel(finalize) == M(1, 1, 16, 0b110)
    assert (
        launch_registers.parse_moe_kernel(reduction.replace("Lb0ELb1ELb0EE", "Lb0ELb1EE")) is None
    )  # a reduction kernel has four flags
    assert launch_registers.parse_kernel(reduction) is None  # not a dense kernel
    dense = (
        "_ZN10flashinfer23trtllm_allreduce_fusion36allreduce_fusion_kernel_twoshot_syncILNS0_"
        "22AllReduceFusionPatternE0EfLi16ELb0EEEvNS0_21AllReduceFusionParamsIT0_EESt5arrayIi"
        "XT1_EES7_"
    )
    assert launch_registers.parse_moe_kernel(dense) is None
    table = {M(0, 1, 16, f): 70 + f for f in (0b0010, 0b0110, 0b1010, 0b1110)}
    table[M(1, 1, 16, 0b110)] = 158
    text = launch_registers.moe_header_text(1, 16, {90: table})
    assert "kRegisters[kNumArchs][2][16]" in text
    assert "{0, 0, 72, 0, 0, 0, 76, 0, 0, 0, 80, 0, 0, 0, 84, 0},  // reduction" in text
    assert "{0, 0, 0, 0, 0, 0, 158, 0, 0, 0, 0, 0, 0, 0, 0, 0},  // finalize" in text
    with pytest.raises(ValueError, match="does not belong"):
        launch_registers.moe_header_text(2, 16, {90: table})
    with pytest.raises(ValueError, match="two register counts"):
        launch_registers.kernel_registers(
            {reduction: 40, reduction + "x": 48}, launch_registers.parse_moe_kernel
        )


def test_moe_probe_cubins_give_the_table(tmp_path):
    """The build's MoE probe cubins, if this checkout has a build: `generate --moe` reads
    every instantiated MoE kernel and writes the header the build compiled with."""
    cubins = sorted((REPO / "build").glob("*/ffi/core/kernels/moe_unhooked_bf16_n2.sm_90a.cubin"))
    if not cubins:
        pytest.skip("no MoE probe cubin built here (cmake --build build/<dir>)")
    out = tmp_path / "moe.h"
    # Every architecture the build compiled (CI: sm_90a and sm_100a), as the build passes them.
    probes = sorted(cubins[0].parent.glob("moe_unhooked_bf16_n2.sm_*.cubin"))
    arch_args = [f"{c.name.split('.sm_')[1].removesuffix('.cubin')}={c}" for c in probes]
    run = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "generate",
            "--moe",
            "--dtype",
            "2",
            "--nranks",
            "2",
            "--out",
            str(out),
            *arch_args,
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    text = out.read_text()
    assert text == (cubins[0].parent / "moe_unhooked_registers_bf16_n2.h").read_text()
    rows = [
        line
        for line in text.splitlines()
        if line.rstrip().endswith(("// reduction", "// finalize"))
    ]
    counts = [[int(v) for v in line.split("{")[1].split("}")[0].split(",")] for line in rows]
    # pattern 6: all-reduce-out and residual-out on/off, norm on, no FP4; pattern 7: one.
    assert [i for i, v in enumerate(counts[0]) if v] == [0b0010, 0b0110, 0b1010, 0b1110]
    assert [i for i, v in enumerate(counts[1]) if v] == [0b110]


def _build_dir() -> pathlib.Path | None:
    candidates = [os.environ.get("JAX_FUSEDAR_BUILD_DIR"), REPO / "build" / "dev"]
    for c in candidates:
        if c and list(pathlib.Path(c).glob("ffi/core/kernels/unhooked_*.cubin")):
            return pathlib.Path(c)
    return None


def test_built_library_keeps_flashinfer_launch_geometry():
    core = REPO / "jax_fusedar" / "libfusedar_core.so"
    build = _build_dir()
    if build is None or not core.exists():
        pytest.skip(f"needs a core built here with its build tree ({BUILD_NATIVE})")
    built = build / "ffi" / "core" / "libfusedar_core.so"
    if not built.exists() or not filecmp.cmp(built, core, shallow=False):
        pytest.skip(f"jax_fusedar/libfusedar_core.so is not the one built in {build}")
    if launch_registers.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    run = subprocess.run(
        [sys.executable, str(TOOL), "check", "--core", str(core), "--build-dir", str(build)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every hooked kernel launches as the unhooked one" in run.stdout
