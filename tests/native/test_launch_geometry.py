"""The bounded waits must not change FlashInfer's launch geometry.

FlashInfer's launcher sizes blocks and clusters from the kernel's register count; the hooked
kernels use a few more registers, so the build pins the geometry to the unhooked kernels'
counts (ffi/kernels/launch_registers.cuh). tools/launch_registers.py check verifies a built
library against its build tree: every kernel (pattern, dtype, world size, accumulation,
one-shot and two-shot, every architecture) is launched as its unhooked twin and fits.
"""

import argparse
import filecmp
import json
import subprocess
import sys

import pytest

from jax_fusedar.common.limits import SUPPORTED_WORLD_SIZES  # the build's, ffi/core/CMakeLists.txt
from tools import launch_registers

from tests.native.host_program import build_tree
from tests.repo import REPO
from tests.skips import BUILD_NATIVE

TOOL = REPO / "tools" / "launch_registers.py"


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


CACHE = REPO / "ffi" / "core" / "unhooked_registers.json"
DEFAULT_ARCHS = ("90a", "100a")  # ffi/core/CMakeLists.txt's default, what CI builds
TRANSLATION_UNITS = [
    launch_registers.tu_name(False, dtype, n) for dtype in (0, 1, 2) for n in SUPPORTED_WORLD_SIZES
] + [launch_registers.tu_name(True, dtype, n) for dtype in (1, 2) for n in SUPPORTED_WORLD_SIZES]


def test_the_register_cache_covers_every_translation_unit_for_one_toolchain():
    """Every kernel translation unit of the default architectures has its counts in the
    cache for one same toolchain (nvcc and host compiler versions), so a build with that
    toolchain compiles no probe."""
    entries = launch_registers.read_cache(str(CACHE))
    wanted = {f"{tu}.sm_{arch}" for tu in TRANSLATION_UNITS for arch in DEFAULT_ARCHS}
    assert set(entries) == wanted, "the cache's translation units are not the build's"
    versions = {e["toolchain_versions"] for name in wanted for e in entries[name]}
    covered = [
        v
        for v in versions
        if all(any(e["toolchain_versions"] == v for e in entries[name]) for name in wanted)
    ]
    assert covered, f"no toolchain has all {len(wanted)} entries"
    assert any("release 13.0" in v for v in covered), covered  # the CUDA this project pins


def test_the_register_cache_gives_the_moe_table():
    """The cached MoE counts of one translation unit make the header the launcher reads:
    exactly the kernels FlashInfer's instantiation compiles."""
    entry = launch_registers.read_cache(str(CACHE))["moe_unhooked_bf16_n2.sm_90a"][0]
    table = launch_registers.table_from_rows(entry["kernels"], True, 2, 2)
    text = launch_registers.moe_header_text(2, 2, {90: table})
    rows = [
        line
        for line in text.splitlines()
        if line.rstrip().endswith(("// reduction", "// finalize"))
    ]
    counts = [[int(v) for v in line.split("{")[1].split("}")[0].split(",")] for line in rows]
    # pattern 6: all-reduce-out and residual-out on/off, norm on, no FP4; pattern 7: one.
    assert [i for i, v in enumerate(counts[0]) if v] == [0b0010, 0b0110, 0b1010, 0b1110]
    assert [i for i, v in enumerate(counts[1]) if v] == [0b110]
    assert all(24 <= v <= 255 for row in counts for v in row if v)


def test_dense_cache_rows_round_trip_through_the_table():
    entry = launch_registers.read_cache(str(CACHE))["unhooked_bf16_n8.sm_100a"][0]
    table = launch_registers.table_from_rows(entry["kernels"], False, 2, 8)
    assert {k.kind for k in table} == {0, 1, 2} and {k.fp32_acc for k in table} == {False, True}
    assert launch_registers.table_rows(table) == entry["kernels"]


def test_make_dependencies_reads_nvcc_m_output():
    text = "x.o : /a/x.cu \\\n    /usr/include/stdc-predef.h /b/with\\ space.h \\\n    /c/last.h\n"
    assert launch_registers.make_dependencies(text) == [
        "/a/x.cu",
        "/usr/include/stdc-predef.h",
        "/b/with space.h",
        "/c/last.h",
    ]


def test_portable_flags_drop_only_paths():
    flags = ["-O3", "-I/src/include", "-I", "/x", "-isystem", "/y", "-DA=1", "/b/k.cu"]
    assert launch_registers.portable_flags(flags, "/b/k.cu") == ["-O3", "-DA=1"]


def _fake_nvcc(tmp_path, deps):
    """An nvcc that answers --version and -M (with `deps`), for the keys alone."""
    script = tmp_path / "nvcc"
    listing = " \\\n ".join(str(d) for d in deps)
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  *--version*) echo "Cuda compilation tools, release 99.0, V99.0.1" ;;\n'
        f'  *-M*) printf "%s\\n" "k.o : {listing}" ;;\n'
        "  *) exit 3 ;;\n"
        "esac\n"
    )
    script.chmod(0o755)
    return str(script)


def test_probe_keys_split_project_and_toolchain_inputs(tmp_path):
    """A project file's content moves the source key only, a system header's the toolchain
    key only; moving the trees elsewhere (same content) moves neither."""
    project, system = tmp_path / "src", tmp_path / "sys"
    for d in (project, system):
        d.mkdir()
    source, header, libc = project / "k.cu", project / "k.cuh", system / "stdio.h"
    for f, text in ((source, "kernel"), (header, "v1"), (libc, "c1")):
        f.write_text(text)
    nvcc = _fake_nvcc(tmp_path, [source, header, libc])

    def keys(src=source, roots=(project,), flags=("-O3",)):
        return launch_registers.probe_keys(
            nvcc, [*flags, f"-I{roots[0]}"], str(src), "90a", [str(r) for r in roots], "v"
        )

    base = keys()
    header.write_text("v2")
    assert keys()[0] != base[0] and keys()[1] == base[1]
    header.write_text("v1")
    libc.write_text("c2")
    assert keys()[0] == base[0] and keys()[1] != base[1]
    libc.write_text("c1")
    assert keys(flags=("-O2",))[0] != base[0]
    moved = tmp_path / "elsewhere"
    project.rename(moved)
    nvcc = _fake_nvcc(tmp_path, [moved / "k.cu", moved / "k.cuh", libc])
    assert keys(src=moved / "k.cu", roots=(moved,)) == base


def _probe_args(tmp_path, cache, verify=False):
    return argparse.Namespace(
        compile=["nvcc", "-O3", str(tmp_path / "k.cu")],
        moe=False,
        dtype=2,
        nranks=2,
        cache=str(cache),
        record=str(tmp_path / "rec.json"),
        out=str(tmp_path / "h.h"),
        arch=["90a"],
        project_root=[str(tmp_path)],
        work_dir=str(tmp_path),
        verify=verify,
    )


def test_probe_takes_the_cache_compiles_on_a_miss_and_verify_catches_a_wrong_cache(
    tmp_path, monkeypatch
):
    K = launch_registers.Kernel
    compiled = {K(0, 1, 2, 2, False): 40, K(2, 1, 2, 2, True): 48}
    calls = []
    monkeypatch.setattr(launch_registers, "toolchain_versions", lambda nvcc, flags: "v")
    monkeypatch.setattr(launch_registers, "probe_keys", lambda *a: ("S", "T"))

    def compile_probe(*args):
        calls.append(args)
        return compiled

    monkeypatch.setattr(launch_registers, "compile_probe", compile_probe)
    cache = tmp_path / "cache.json"
    launch_registers.write_cache(str(cache), {})
    # A miss compiles, and the record says so; store puts it into the cache.
    assert launch_registers.probe(_probe_args(tmp_path, cache)) == 0
    record = json.loads((tmp_path / "rec.json").read_text())["entries"]["unhooked_bf16_n2.sm_90a"]
    assert record["from"] == "probe" and len(calls) == 1
    header = (tmp_path / "h.h").read_text()
    (tmp_path / "build").mkdir()
    (tmp_path / "rec.json").rename(tmp_path / "build" / "unhooked_bf16_n2.registers.json")
    launch_registers.store(argparse.Namespace(build_dir=str(tmp_path / "build"), cache=str(cache)))
    # A hit compiles nothing and writes the same header.
    (tmp_path / "h.h").unlink()
    assert launch_registers.probe(_probe_args(tmp_path, cache)) == 0
    assert len(calls) == 1 and (tmp_path / "h.h").read_text() == header
    record = json.loads((tmp_path / "rec.json").read_text())["entries"]["unhooked_bf16_n2.sm_90a"]
    assert record["from"] == "cache"
    # --verify compiles anyway; a cache that disagrees with the compile fails the build.
    assert launch_registers.probe(_probe_args(tmp_path, cache, verify=True)) == 0
    assert len(calls) == 2
    compiled = {**compiled, K(0, 1, 2, 2, False): 56}
    with pytest.raises(SystemExit, match="disagrees with the probe"):
        launch_registers.probe(_probe_args(tmp_path, cache, verify=True))


def test_probe_refuses_a_repeated_architecture_and_a_missing_compile_command(tmp_path):
    cache = tmp_path / "cache.json"
    launch_registers.write_cache(str(cache), {})
    args = _probe_args(tmp_path, cache)
    args.arch = ["90a", "sm_90a"]
    with pytest.raises(SystemExit, match="an architecture is given twice"):
        launch_registers.probe(args)
    args = _probe_args(tmp_path, cache)
    args.compile = ["nvcc"]
    with pytest.raises(SystemExit, match="give the compile command after --"):
        launch_registers.probe(args)
    assert not (tmp_path / "h.h").exists() and not (tmp_path / "rec.json").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no probe records"):
        launch_registers.store(
            argparse.Namespace(build_dir=str(tmp_path / "empty"), cache=str(cache))
        )


def test_store_keeps_one_entry_per_toolchain_for_the_current_source(tmp_path):
    def record(source, toolchain, regs):
        return {
            "source": source,
            "toolchain": toolchain,
            "toolchain_versions": toolchain,
            "kernels": [[0, 1, 0, regs]],
        }

    cache = tmp_path / "cache.json"
    name = "unhooked_f16_n4.sm_90a"
    launch_registers.write_cache(
        str(cache), {name: [record("S1", "T1", 40), record("S2", "T2", 42)]}
    )
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "unhooked_f16_n4.registers.json").write_text(
        json.dumps({"entries": {name: {**record("S2", "T1", 44), "from": "probe"}}})
    )
    launch_registers.store(argparse.Namespace(build_dir=str(tmp_path / "build"), cache=str(cache)))
    kept = launch_registers.read_cache(str(cache))[name]
    # The older source's entry is gone, the other toolchain's entry for this source stays.
    assert [(e["source"], e["toolchain"]) for e in kept] == [("S2", "T2"), ("S2", "T1")]


def _build_dir():
    return build_tree("ffi/core/kernels/unhooked_*.registers.json")


def test_the_register_cache_is_current_for_the_toolchain_it_holds():
    """The cache holds the keys of every probe of this checkout's build, for a toolchain
    the cache knows: else the kernel sources changed since the cache was written, and
    every clean build (CI's too) compiles the probes again, about 40% of the kernels'
    build time."""
    build = _build_dir()
    if build is None:
        pytest.skip(f"needs a build tree with the kernels ({BUILD_NATIVE})")
    records = {
        **launch_registers.read_records(str(build), False),
        **launch_registers.read_records(str(build), True),
    }
    cached = launch_registers.read_cache(str(CACHE))
    missing = {
        name: r
        for name, r in records.items()
        if not any(
            e["source"] == r["source"] and e["toolchain"] == r["toolchain"]
            for e in cached.get(name, [])
        )
    }
    known = {e["toolchain_versions"] for entries in cached.values() for e in entries}
    stale = sorted(n for n, r in missing.items() if r["toolchain_versions"] in known)
    if missing and not stale:
        version = next(iter(missing.values()))["toolchain_versions"].splitlines()
        pytest.skip(f"the cache holds no counts for this toolchain ({'; '.join(version)})")
    assert not stale, (
        f"the cache lacks {len(stale)} probes of this build ({', '.join(stale)}): run python"
        f" tools/launch_registers.py store --build-dir {build} and commit {CACHE.name}"
    )


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
