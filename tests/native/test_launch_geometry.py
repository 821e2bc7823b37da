"""The bounded waits must not change FlashInfer's launch geometry: its launcher sizes blocks
and clusters from the register count, the hooked kernels use a few more, so the build pins the
geometry to the unhooked kernels' counts (ffi/kernels/launch_registers.cuh), which
tools/launch_registers.py probes, caches and checks against a built library."""

import argparse
import filecmp
import itertools
import json
import subprocess
import sys

import pytest

from jax_fusedar.common.limits import SUPPORTED_WORLD_SIZES  # the build's, ffi/core/CMakeLists.txt
from tools import launch_registers as lr

from tests.native.host_program import build_tree
from tests.repo import REPO
from tests.skips import BUILD_NATIVE

Kernel, MoeKernel = lr.Kernel, lr.MoeKernel
NS = "_ZN10flashinfer23trtllm_allreduce_fusion"
ONESHOT = (
    f"{NS}39allreduce_fusion_kernel_oneshot_lamportILNS0_22AllReduceFusionPatternE11E13__nv_"
    "bfloat16Li8ELb1ELb0EEEvNS0_21AllReduceFusionParamsIT0_EE"
)
TWOSHOT = (
    f"{NS}36allreduce_fusion_kernel_twoshot_syncILNS0_22AllReduceFusionPatternE0EfLi16ELb0EEEvNS0_"
    "21AllReduceFusionParamsIT0_EESt5arrayIiXT1_EES7_"
)
MOE_NS = "_ZN10flashinfer27trtllm_moe_allreduce_fusion"
REDUCTION = (
    f"{MOE_NS}49moereduce_allreduce_fusion_kernel_oneshot_lamportI13__nv_bfloat16Li2ELb1ELb0ELb1E"
    "Lb0EEEvNS0_33MoeReductionAllReduceFusionParamsIT_EE"
)
FINALIZE = (
    f"{MOE_NS}51moefinalize_allreduce_fusion_kernel_oneshot_lamportI6__halfLi16ELb1ELb1ELb0ES2_EE"
    "vNS0_32MoeFinalizeAllReduceFusionParamsIT_EE"
)


@pytest.mark.parametrize(
    "parse, mangled, kernel",
    [
        (lr.parse_kernel, ONESHOT, Kernel(0, 11, 2, 8, True)),
        (lr.parse_kernel, TWOSHOT, Kernel(2, 0, 0, 16, False)),
        (lr.parse_kernel, "_ZN7fusedar18fill_negative_zeroEP5uint4lj", None),
        # The MoE kernels (patterns 6, 7): their bool template flags as the index
        # moe_launch_registers.cuh computes (first flag highest).
        (lr.parse_moe_kernel, REDUCTION, MoeKernel(0, 2, 2, 0b1010)),
        (lr.parse_moe_kernel, FINALIZE, MoeKernel(1, 1, 16, 0b110)),
        # A reduction kernel has four flags.
        (lr.parse_moe_kernel, REDUCTION.replace("Lb0ELb1ELb0EE", "Lb0ELb1EE"), None),
        (lr.parse_kernel, REDUCTION, None),  # not a dense kernel
        (lr.parse_moe_kernel, TWOSHOT, None),
    ],
    ids="oneshot twoshot other reduction finalize 3_flags moe_as_dense dense_as_moe".split(),
)
def test_mangled_kernel_names_name_their_instance(parse, mangled, kernel):
    assert parse(mangled) == kernel


def test_geometry_reproduces_the_parity_break_the_pin_prevents():
    # 1024 x 8192 bf16 two-shot on 2 ranks: the unhooked kernel (64 registers) runs 1024-thread
    # blocks without clusters; the hooked one (72 registers) would run 512 threads x cluster 2,
    # which reorders RMSNorm's reduction (340 differing bytes against FlashInfer's build).
    shape = dict(hidden_dim=8192, tokens=1024, elem_bytes=2, nranks=2, oneshot=False)
    geometry = lr.flashinfer_geometry
    assert geometry(64, **shape) == (1024, 1) and geometry(72, **shape) == (512, 2)
    # Every count up to 64 is one bucket there; above it, single registers matter (7168).
    assert {geometry(r, **shape) for r in range(24, 65)} == {(1024, 1)}
    s7168 = dict(shape, hidden_dim=7168)
    assert geometry(72, **s7168) != geometry(74, **s7168)


def test_header_round_trip_keeps_every_count():
    grid = itertools.product(range(3), (0, 1, 11), (0, 1))
    table = {Kernel(kind, p, 1, 4, acc): 30 + kind + p + acc for kind, p, acc in grid}
    text = lr.header_text(1, 4, {90: table, 100: {k: r + 1 for k, r in table.items()}})
    assert "kArchs[kNumArchs] = {90, 100}" in text
    assert "{41, 42}, {0, 0}" in text  # pattern 11 (then 12: none), one-shot, sm_90
    with pytest.raises(ValueError, match="does not belong"):
        lr.header_text(2, 4, {90: table})


def test_moe_header_text():
    table = {MoeKernel(0, 1, 16, f): 70 + f for f in (0b0010, 0b0110, 0b1010, 0b1110)}
    table[MoeKernel(1, 1, 16, 0b110)] = 158
    text = lr.moe_header_text(1, 16, {90: table})
    assert "kRegisters[kNumArchs][2][16]" in text
    assert "{0, 0, 72, 0, 0, 0, 76, 0, 0, 0, 80, 0, 0, 0, 84, 0},  // reduction" in text
    assert "{0, 0, 0, 0, 0, 0, 158, 0, 0, 0, 0, 0, 0, 0, 0, 0},  // finalize" in text
    with pytest.raises(ValueError, match="does not belong"):
        lr.moe_header_text(2, 16, {90: table})
    with pytest.raises(ValueError, match="two register counts"):
        lr.kernel_registers({REDUCTION: 40, REDUCTION + "x": 48}, lr.parse_moe_kernel)


CACHE = REPO / "ffi" / "core" / "unhooked_registers.json"
PROBE_RECORDS = "ffi/core/kernels/unhooked_*.registers.json"  # what a build tree holds
DEFAULT_ARCHS = ("90a", "100a")  # ffi/core/CMakeLists.txt's default, what CI builds
TRANSLATION_UNITS = [
    lr.tu_name(moe, dtype, n)
    for moe, dtypes in ((False, (0, 1, 2)), (True, (1, 2)))
    for dtype in dtypes
    for n in SUPPORTED_WORLD_SIZES
]


def test_the_register_cache_covers_every_translation_unit_for_one_toolchain():
    """Every kernel translation unit of the default architectures has its counts in the cache
    for one same toolchain (nvcc and host compiler versions): a build with it compiles no probe."""
    entries = lr.read_cache(str(CACHE))
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


def test_the_register_cache_gives_the_moe_table_and_dense_rows_round_trip():
    """The cached MoE counts of one translation unit make the header the launcher reads:
    exactly the kernels FlashInfer's instantiation compiles; the dense rows round-trip."""
    cache = lr.read_cache(str(CACHE))
    entry = cache["moe_unhooked_bf16_n2.sm_90a"][0]
    text = lr.moe_header_text(2, 2, {90: lr.table_from_rows(entry["kernels"], True, 2, 2)})
    ends = ("// reduction", "// finalize")
    rows = [line for line in text.splitlines() if line.rstrip().endswith(ends)]
    counts = [[int(v) for v in line.split("{")[1].split("}")[0].split(",")] for line in rows]
    # pattern 6: all-reduce-out and residual-out on/off, norm on, no FP4; pattern 7: one.
    assert [i for i, v in enumerate(counts[0]) if v] == [0b0010, 0b0110, 0b1010, 0b1110]
    assert [i for i, v in enumerate(counts[1]) if v] == [0b110]
    assert all(24 <= v <= 255 for row in counts for v in row if v)
    entry = cache["unhooked_bf16_n8.sm_100a"][0]
    table = lr.table_from_rows(entry["kernels"], False, 2, 8)
    assert {k.kind for k in table} == {0, 1, 2} and {k.fp32_acc for k in table} == {False, True}
    assert lr.table_rows(table) == entry["kernels"]


def test_make_dependencies_and_portable_flags():
    text = "x.o : /a/x.cu \\\n    /usr/include/stdc-predef.h /b/with\\ space.h \\\n    /c/last.h\n"
    deps = ["/a/x.cu", "/usr/include/stdc-predef.h", "/b/with space.h", "/c/last.h"]
    assert lr.make_dependencies(text) == deps
    # The portable flags drop only paths.
    flags = ["-O3", "-I/src/include", "-I", "/x", "-isystem", "/y", "-DA=1", "/b/k.cu"]
    assert lr.portable_flags(flags, "/b/k.cu") == ["-O3", "-DA=1"]


def _fake_nvcc(tmp_path, deps):
    """An nvcc that answers --version and -M (with `deps`), for the keys alone."""
    script = tmp_path / "nvcc"
    listing = " \\\n ".join(str(d) for d in deps)
    script.write_text(
        '#!/bin/sh\ncase "$*" in\n'
        '  *--version*) echo "Cuda compilation tools, release 99.0, V99.0.1" ;;\n'
        f'  *-M*) printf "%s\\n" "k.o : {listing}" ;;\n'
        "  *) exit 3 ;;\nesac\n"
    )
    script.chmod(0o755)
    return str(script)


def test_probe_keys_split_project_and_toolchain_inputs(tmp_path):
    """A project file's content moves the source key only, a system header's the toolchain
    key only; moving the trees elsewhere (same content) moves neither."""
    project, system = tmp_path / "src", tmp_path / "sys"
    source, header, libc = project / "k.cu", project / "k.cuh", system / "stdio.h"
    for f, text in ((source, "kernel"), (header, "v1"), (libc, "c1")):
        f.parent.mkdir(exist_ok=True)
        f.write_text(text)
    nvcc = _fake_nvcc(tmp_path, [source, header, libc])

    def keys(src=source, roots=(project,), flags=("-O3",)):
        return lr.probe_keys(
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
        **dict(compile=["nvcc", "-O3", str(tmp_path / "k.cu")], moe=False, dtype=2, nranks=2),
        **dict(cache=str(cache), record=str(tmp_path / "rec.json"), out=str(tmp_path / "h.h")),
        **dict(arch=["90a"], project_root=[str(tmp_path)], work_dir=str(tmp_path), verify=verify),
    )


def _store(build_dir, cache):
    return lr.store(argparse.Namespace(build_dir=str(build_dir), cache=str(cache)))


def test_probe_compiles_on_a_miss_only_and_verify_catches_a_wrong_cache(tmp_path, monkeypatch):
    compiled = {Kernel(0, 1, 2, 2, False): 40, Kernel(2, 1, 2, 2, True): 48}
    calls = []
    monkeypatch.setattr(lr, "toolchain_versions", lambda nvcc, flags: "v")
    monkeypatch.setattr(lr, "probe_keys", lambda *a: ("S", "T"))
    monkeypatch.setattr(lr, "compile_probe", lambda *args: calls.append(args) or compiled)
    cache, record = tmp_path / "cache.json", tmp_path / "rec.json"
    lr.write_cache(str(cache), {})

    def entry():
        return json.loads(record.read_text())["entries"]["unhooked_bf16_n2.sm_90a"]

    # A miss compiles, and the record says so; store puts it into the cache.
    assert lr.probe(_probe_args(tmp_path, cache)) == 0
    assert entry()["from"] == "probe" and len(calls) == 1
    header = (tmp_path / "h.h").read_text()
    (tmp_path / "build").mkdir()
    record.rename(tmp_path / "build" / "unhooked_bf16_n2.registers.json")
    _store(tmp_path / "build", cache)
    # A hit compiles nothing and writes the same header.
    (tmp_path / "h.h").unlink()
    assert lr.probe(_probe_args(tmp_path, cache)) == 0
    assert len(calls) == 1 and (tmp_path / "h.h").read_text() == header
    assert entry()["from"] == "cache"
    # --verify compiles anyway; a cache that disagrees with the compile fails the build.
    assert lr.probe(_probe_args(tmp_path, cache, verify=True)) == 0
    assert len(calls) == 2
    compiled = {**compiled, Kernel(0, 1, 2, 2, False): 56}
    with pytest.raises(SystemExit, match="disagrees with the probe"):
        lr.probe(_probe_args(tmp_path, cache, verify=True))


def test_probe_refuses_a_repeated_architecture_and_a_missing_compile_command(tmp_path):
    cache = tmp_path / "cache.json"
    lr.write_cache(str(cache), {})
    for field, value, match in (
        ("arch", ["90a", "sm_90a"], "an architecture is given twice"),
        ("compile", ["nvcc"], "give the compile command after --"),
    ):
        args = _probe_args(tmp_path, cache)
        setattr(args, field, value)
        with pytest.raises(SystemExit, match=match):
            lr.probe(args)
    assert not (tmp_path / "h.h").exists() and not (tmp_path / "rec.json").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no probe records"):
        _store(tmp_path / "empty", cache)


def test_store_keeps_one_entry_per_toolchain_for_the_current_source(tmp_path):
    def record(source, tool, regs):
        return dict(
            source=source, toolchain=tool, toolchain_versions=tool, kernels=[[0, 1, 0, regs]]
        )

    cache, name = tmp_path / "cache.json", "unhooked_f16_n4.sm_90a"
    lr.write_cache(str(cache), {name: [record("S1", "T1", 40), record("S2", "T2", 42)]})
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "unhooked_f16_n4.registers.json").write_text(
        json.dumps({"entries": {name: {**record("S2", "T1", 44), "from": "probe"}}})
    )
    _store(tmp_path / "build", cache)
    kept = lr.read_cache(str(cache))[name]
    # The older source's entry is gone, the other toolchain's entry for this source stays.
    assert [(e["source"], e["toolchain"]) for e in kept] == [("S2", "T2"), ("S2", "T1")]


def test_the_register_cache_is_current_for_the_toolchain_it_holds():
    """The cache holds the keys of every probe of this checkout's build, for a toolchain the
    cache knows: else the kernel sources changed since the cache was written, and every clean
    build (CI's too) compiles the probes again, about 40% of the kernels' build time."""
    build = build_tree(PROBE_RECORDS)
    if build is None:
        pytest.skip(f"needs a build tree with the kernels ({BUILD_NATIVE})")
    records = {**lr.read_records(str(build), False), **lr.read_records(str(build), True)}
    cached = lr.read_cache(str(CACHE))
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
    build = build_tree(PROBE_RECORDS)
    if build is None or not core.exists():
        pytest.skip(f"needs a core built here with its build tree ({BUILD_NATIVE})")
    built = build / "ffi" / "core" / "libfusedar_core.so"
    if not built.exists() or not filecmp.cmp(built, core, shallow=False):
        pytest.skip(f"jax_fusedar/libfusedar_core.so is not the one built in {build}")
    if lr.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    tool = REPO / "tools" / "launch_registers.py"
    run = subprocess.run(
        [sys.executable, str(tool), "check", "--core", str(core), "--build-dir", str(build)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every hooked kernel launches as the unhooked one" in run.stdout
