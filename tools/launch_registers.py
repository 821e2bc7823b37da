#!/usr/bin/env python3
"""Register counts of FlashInfer's fused all-reduce kernels (dense and MoE), hooked and unhooked.

FlashInfer's launcher sizes blocks and clusters from the kernel's register count, and the
block/cluster split decides RMSNorm's reduction order, so the kernels with bounded waits
must launch exactly as the unhooked ones would (ffi/kernels/launch_registers.cuh). The build
needs, per kernel translation unit, the register counts of its kernels compiled without the
hooks ("probe" cubins), and this tool

  probe     writes the per-translation-unit header of the unhooked counts the launcher uses
            (the build runs it for every translation unit):
              launch_registers.py probe --dtype 2 --nranks 2 --out H --cache C --record R
                  --arch 90a --arch 100a --project-root SRC --project-root BUILD
                  -- NVCC FLAGS... SOURCE
            For each architecture it takes the counts from the cache C
            (ffi/core/unhooked_registers.json) when the cache holds them for exactly this
            input, else compiles the probe cubin (nvcc -cubin, device code only) and reads
            them from it. The input is named by two SHA-256 keys: "source" (the probe's
            flags but include and output paths, and the content of every file the
            preprocessor reads from the project's trees, FlashInfer's headers included) and
            "toolchain" (nvcc's and the host compiler's versions, NVCC_* environment
            variables, the content of every other file it reads: the CUDA and system
            headers). nvcc is deterministic, so equal keys give equal counts; with --verify
            the counts are compiled anyway and a cache that disagrees fails the build. The
            record R says, per architecture, the keys, the counts and where they came from.
  store     copies the counts that the build compiled (the records under --build-dir whose
            counts came from a probe) into the cache, so that the next build reads them:
              launch_registers.py store --build-dir build/dev
  check     verifies a built libfusedar_core.so against the records of its build tree:
              launch_registers.py check --core jax_fusedar/libfusedar_core.so --build-dir build/dev
            every kernel of every pattern, dtype, world size, accumulation mode, one-shot and
            two-shot, on every architecture: the generated headers hold exactly the unhooked
            counts (so the launch geometry is FlashInfer's), and each hooked kernel's register
            allocation is at most the unhooked one's (so every block size FlashInfer picks
            fits). It prints the counts and the (threads per block, cluster size) that
            FlashInfer's launcher gives for a few shapes: with the pinned (unhooked) counts
            and with the hooked kernels' own counts, to show what the pin prevents.

The MoE kernels (patterns 6, 7; ffi/kernels/moe_launch_registers.cuh) get the same pin
without the geometry part (their launchers read no register count): `probe --moe` writes
their unhooked counts, which cap the hooked kernels' registers, and `check` covers them too.

Reading cubins needs no CUDA tool (the counts are EIATTR_REGCOUNT entries of the ELF's
.nv.info section); reading the library's compressed fatbin needs cuobjdump (CUDA toolkit,
or pip install nvidia-cuda-cuobjdump).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass

# Kinds of kernel per instance, in the order of the generated table (launch_registers.cuh).
KINDS = ("oneshot_notrigger", "oneshot_trigger", "twoshot")
MAX_PATTERNS = 16  # the table's pattern dimension; FlashInfer's patterns are 0..11
DTYPES = {"f": 0, "6__half": 1, "13__nv_bfloat16": 2}
DTYPE_NAMES = ("f32", "f16", "bf16")
ALLOCATION_UNIT = 8  # registers per thread: allocated per warp in units of 256
MAX_REGISTERS_PER_THREAD = 255

_KERNEL = re.compile(
    r"^_ZN10flashinfer23trtllm_allreduce_fusion(?:39allreduce_fusion_kernel_oneshot_lamport|"
    r"36allreduce_fusion_kernel_twoshot_sync)ILNS0_22AllReduceFusionPatternE(?P<pattern>\d+)E"
    r"(?P<dtype>f|6__half|13__nv_bfloat16)Li(?P<nranks>\d+)ELb(?P<acc>[01])E"
    r"(?:Lb(?P<trigger>[01])E)?E"
)


# FlashInfer's MoE kernels: reduction (pattern 6; template flags AllReduceOut, ResidualOut,
# NormOut, QuantOut) and finalize (pattern 7; ResidualOut, NormOut, QuantOut, then ScaleType).
MOE_KINDS = ("reduction", "finalize")
MOE_FLAG_COMBINATIONS = 16  # the table's flag dimension: the flags as bits, first flag highest
_MOE_KERNEL = re.compile(
    r"^_ZN10flashinfer27trtllm_moe_allreduce_fusion(?:(?P<reduction>49moereduce_allreduce_"
    r"fusion_kernel_oneshot_lamport)|51moefinalize_allreduce_fusion_kernel_oneshot_lamport)I"
    r"(?P<dtype>6__half|13__nv_bfloat16)Li(?P<nranks>\d+)E(?P<flags>(?:Lb[01]E)+)"
)


@dataclass(frozen=True, order=True)
class MoeKernel:
    kind: int  # index into MOE_KINDS
    dtype: int
    nranks: int
    flags: int  # the template's bool flags as bits, the first one highest

    def describe(self) -> str:
        return (
            f"moe_{MOE_KINDS[self.kind]:9s} {DTYPE_NAMES[self.dtype]:4s} n{self.nranks:<2d} "
            f"flags{self.flags:04b}"
        )


def parse_moe_kernel(mangled: str) -> MoeKernel | None:
    """The MoE instance a mangled kernel name denotes; None for any other function."""
    m = _MOE_KERNEL.match(mangled)
    if not m:
        return None
    bits = re.findall(r"Lb([01])E", m.group("flags"))
    if len(bits) != (4 if m.group("reduction") else 3):
        return None
    return MoeKernel(
        0 if m.group("reduction") else 1,
        DTYPES[m.group("dtype")],
        int(m.group("nranks")),
        int("".join(bits), 2),
    )


@dataclass(frozen=True, order=True)
class Kernel:
    kind: int  # index into KINDS
    pattern: int
    dtype: int
    nranks: int
    fp32_acc: bool

    def describe(self) -> str:
        return (
            f"{KINDS[self.kind]:17s} p{self.pattern:<2d} {DTYPE_NAMES[self.dtype]:4s} "
            f"n{self.nranks:<2d} acc{int(self.fp32_acc)}"
        )


def parse_kernel(mangled: str) -> Kernel | None:
    """The instance a mangled kernel name denotes; None for any other function."""
    m = _KERNEL.match(mangled)
    if not m:
        return None
    if m.group("trigger") is None:
        kind = 2
    else:
        kind = 1 if m.group("trigger") == "1" else 0
    return Kernel(
        kind,
        int(m.group("pattern")),
        DTYPES[m.group("dtype")],
        int(m.group("nranks")),
        m.group("acc") == "1",
    )


def cubin_registers(data: bytes) -> dict[str, int]:
    """{mangled function name: registers per thread} from an uncompressed cubin (ELF64)."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]

    def cstr(offset: int) -> str:
        return data[offset : data.index(b"\0", offset)].decode()

    names_at = sections[shstrndx][4]
    symtab = next(s for s in sections if s[1] == 2)  # SHT_SYMTAB
    strings_at = sections[symtab[6]][4]
    symbols = [
        cstr(strings_at + struct.unpack_from("<I", data, symtab[4] + i * 24)[0])
        for i in range(symtab[5] // 24)
    ]
    out = {}
    for name_off, _type, _flags, _addr, offset, size, *_ in sections:
        if cstr(names_at + name_off) != ".nv.info":
            continue
        pos, end = offset, offset + size
        while pos < end:
            fmt, attr = data[pos], data[pos + 1]
            if fmt == 4:  # EIFMT_SVAL: u16 size, then the payload
                (length,) = struct.unpack_from("<H", data, pos + 2)
                if attr == 0x2F:  # EIATTR_REGCOUNT: u32 symbol index, u32 registers
                    symbol, registers = struct.unpack_from("<II", data, pos + 4)
                    out[symbols[symbol]] = registers
                pos += 4 + length
            else:  # the other formats carry at most a u16 in the entry itself
                pos += 4
    return out


def kernel_registers(function_registers: dict[str, int], parse=None) -> dict:
    """{kernel: registers} of the functions `parse` (parse_kernel by default, or
    parse_moe_kernel) recognises."""
    parse = parse or parse_kernel
    out = {}
    for name, registers in function_registers.items():
        kernel = parse(name)
        if kernel is not None:
            if kernel in out and out[kernel] != registers:
                raise ValueError(f"{kernel.describe()}: two register counts")
            out[kernel] = registers
    return out


def arch_number(arch: str) -> int:
    """'90a' or 'sm_90a' -> 90, as the launcher computes it from the device (major*10+minor)."""
    m = re.fullmatch(r"(?:sm_)?(\d+)[a-z]?", arch)
    if not m:
        raise ValueError(f"unrecognised architecture {arch!r}")
    return int(m.group(1))


def header_text(dtype: int, nranks: int, by_arch: dict[int, dict[Kernel, int]]) -> str:
    """The generated header for one translation unit (read by launch_registers.cuh)."""
    archs = sorted(by_arch)
    lines = [
        "// Generated by tools/launch_registers.py from this translation unit's kernels compiled",
        "// without the bounded waits: registers per thread of each unhooked kernel, as",
        "// cudaFuncGetAttributes reports them to FlashInfer's launcher. Do not edit.",
        "#pragma once",
        "#define FUSEDAR_UNHOOKED_REGISTERS_INCLUDED 1",
        "namespace fusedar_geometry::unhooked {",
        f"inline constexpr int kDtype = {dtype};  // {DTYPE_NAMES[dtype]}",
        f"inline constexpr int kNRanks = {nranks};",
        f"inline constexpr int kNumArchs = {len(archs)};",
        f"inline constexpr int kArchs[kNumArchs] = {{{', '.join(map(str, archs))}}};",
        "// [arch][kind: one-shot without/with completion trigger at end, two-shot][pattern]",
        "// [fp32_acc]; 0 where the kernel is not instantiated.",
        f"inline constexpr unsigned char kRegisters[kNumArchs][3][{MAX_PATTERNS}][2] = {{",
    ]
    for arch in archs:
        table = by_arch[arch]
        for kernel in table:
            if kernel.dtype != dtype or kernel.nranks != nranks:
                raise ValueError(
                    f"sm_{arch}: {kernel.describe()} does not belong to "
                    f"{DTYPE_NAMES[dtype]} n{nranks}"
                )
            if kernel.pattern >= MAX_PATTERNS:
                raise ValueError(f"pattern {kernel.pattern} >= {MAX_PATTERNS}")
        lines.append(f"  {{  // sm_{arch}")
        for kind, kind_name in enumerate(KINDS):
            rows = []
            for pattern in range(MAX_PATTERNS):
                pair = [
                    table.get(Kernel(kind, pattern, dtype, nranks, acc), 0) for acc in (False, True)
                ]
                rows.append(f"{{{pair[0]}, {pair[1]}}}")
            lines.append(f"    {{{', '.join(rows)}}},  // {kind_name}")
        lines.append("  },")
    lines += ["};", "}  // namespace fusedar_geometry::unhooked", ""]
    return "\n".join(lines)


def moe_header_text(dtype: int, nranks: int, by_arch: dict[int, dict[MoeKernel, int]]) -> str:
    """The generated header of one MoE translation unit (read by moe_launch_registers.cuh)."""
    archs = sorted(by_arch)
    lines = [
        "// Generated by tools/launch_registers.py from this translation unit's MoE kernels",
        "// compiled without the bounded waits: registers per thread of each unhooked kernel.",
        "// Do not edit.",
        "#pragma once",
        "#define FUSEDAR_MOE_UNHOOKED_REGISTERS_INCLUDED 1",
        "namespace fusedar_geometry::moe_unhooked {",
        f"inline constexpr int kDtype = {dtype};  // {DTYPE_NAMES[dtype]}",
        f"inline constexpr int kNRanks = {nranks};",
        f"inline constexpr int kNumArchs = {len(archs)};",
        f"inline constexpr int kArchs[kNumArchs] = {{{', '.join(map(str, archs))}}};",
        "// [arch][kind: reduction, finalize][the kernel's bool template flags as bits, the",
        "// first one highest]; 0 where the kernel is not instantiated.",
        f"inline constexpr unsigned char kRegisters[kNumArchs][{len(MOE_KINDS)}]"
        f"[{MOE_FLAG_COMBINATIONS}] = {{",
    ]
    for arch in archs:
        table = by_arch[arch]
        for kernel in table:
            if kernel.dtype != dtype or kernel.nranks != nranks:
                raise ValueError(
                    f"sm_{arch}: {kernel.describe()} does not belong to "
                    f"{DTYPE_NAMES[dtype]} n{nranks}"
                )
        lines.append(f"  {{  // sm_{arch}")
        for kind, kind_name in enumerate(MOE_KINDS):
            row = [
                str(table.get(MoeKernel(kind, dtype, nranks, flags), 0))
                for flags in range(MOE_FLAG_COMBINATIONS)
            ]
            lines.append(f"    {{{', '.join(row)}}},  // {kind_name}")
        lines.append("  },")
    lines += ["};", "}  // namespace fusedar_geometry::moe_unhooked", ""]
    return "\n".join(lines)


def find_cuobjdump(explicit: str | None = None) -> str | None:
    candidates = [
        explicit,
        os.environ.get("CUOBJDUMP"),
        shutil.which("cuobjdump"),
        "/usr/local/cuda/bin/cuobjdump",
    ]
    try:  # pip install nvidia-cuda-cuobjdump
        import nvidia  # type: ignore[import-not-found]

        for root in getattr(nvidia, "__path__", []):
            candidates += sorted(glob.glob(os.path.join(root, "*", "bin", "cuobjdump")))
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def library_registers(core: str, cuobjdump: str, parse=None) -> dict[int, dict]:
    """{arch: {kernel: registers}} of every fused kernel (`parse`: parse_kernel by default,
    or parse_moe_kernel) in a built library."""
    parse = parse or parse_kernel
    text = subprocess.run(
        [cuobjdump, "--dump-resource-usage", core], check=True, capture_output=True, text=True
    ).stdout
    out: dict[int, dict[Kernel, int]] = {}
    arch = None
    function = None
    for line in text.splitlines():
        m = re.match(r"\s*arch = (sm_\w+)", line)
        if m:
            arch = arch_number(m.group(1))
            continue
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            function = m.group(1)
            continue
        m = re.search(r"\bREG:(\d+)", line)
        if m and function is not None and arch is not None:
            kernel = parse(function)
            if kernel is not None:
                table = out.setdefault(arch, {})
                if kernel in table and table[kernel] != int(m.group(1)):
                    raise ValueError(f"sm_{arch} {kernel.describe()}: two register counts")
                table[kernel] = int(m.group(1))
            function = None
    return out


def allocated(registers: int) -> int:
    return min(-(-registers // ALLOCATION_UNIT) * ALLOCATION_UNIT, MAX_REGISTERS_PER_THREAD)


def flashinfer_geometry(
    registers: int,
    *,
    hidden_dim: int,
    tokens: int,
    elem_bytes: int,
    nranks: int,
    oneshot: bool,
    sm_count: int = 132,
    max_cluster_size: int = 8,
) -> tuple[int, int]:
    """(threads per block, cluster size) from FlashInfer 0.7.2's allreduce_fusion_kernel_launcher
    for a non-FP4, non-group-quant pattern (the FP4 and group-FP8 adjustments also depend on the
    register count only through the same maximum block size). sm_count 132: H100/H200."""
    vec = 16 // elem_bytes
    cluster_num = tokens if oneshot else -(-tokens // nranks)
    threads_per_token = hidden_dim // vec
    cluster = min(8, max_cluster_size)
    while threads_per_token % cluster and cluster > 1:
        cluster //= 2
    threads = threads_per_token // cluster
    while threads < 128 and cluster >= 2:
        threads *= 2
        cluster //= 2
    max_threads = min(65536 // registers, 1024)
    while cluster_num * cluster > sm_count and cluster > 1 and threads <= max_threads // 2:
        threads *= 2
        cluster //= 2
    return threads, cluster


# (tokens, hidden_dim): one-shot kernels run the first three, two-shot kernels the rest.
GEOMETRY_SHAPES = ((128, 4096), (128, 7168), (128, 8192), (1024, 7168), (1024, 8192), (4096, 8192))
ONESHOT_MAX_TOKENS = 128


def write_if_changed(path: str, text: str) -> None:
    """Rewrites only on change, so an unchanged table does not recompile the kernels."""
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    with open(path, "w") as f:
        f.write(text)


# ---- probe: the unhooked counts of one translation unit, from the cache or from nvcc ----

CACHE_ABOUT = (
    "Unhooked register counts of the kernel translation units, per architecture, keyed by "
    "everything the probe compile reads (tools/launch_registers.py probe; refresh with "
    "tools/launch_registers.py store --build-dir BUILD after a build that compiled probes)."
)


def tu_name(moe: bool, dtype: int, nranks: int) -> str:
    """'unhooked_bf16_n2' / 'moe_unhooked_bf16_n2': the probe's and its header's stem."""
    return f"{'moe_' if moe else ''}unhooked_{DTYPE_NAMES[dtype]}_n{nranks}"


def table_rows(table: dict) -> list[list[int]]:
    """A register table as JSON rows: dense [kind, pattern, fp32_acc, registers], MoE
    [kind, flags, registers], sorted."""
    rows = []
    for kernel, registers in sorted(table.items()):
        if isinstance(kernel, MoeKernel):
            rows.append([kernel.kind, kernel.flags, registers])
        else:
            rows.append([kernel.kind, kernel.pattern, int(kernel.fp32_acc), registers])
    return rows


def table_from_rows(rows: list, moe: bool, dtype: int, nranks: int) -> dict:
    if moe:
        return {MoeKernel(kind, dtype, nranks, flags): r for kind, flags, r in rows}
    return {Kernel(kind, pattern, dtype, nranks, bool(acc)): r for kind, pattern, acc, r in rows}


def make_dependencies(text: str) -> list[str]:
    """The prerequisites of a make rule (nvcc -M's output), in order."""
    body = text.replace("\\\n", " ")
    _, _, deps = body.partition(": ")
    out = []
    for token in re.split(r"(?<!\\)\s+", deps.strip()):
        dep = token.replace("\\ ", " ")
        if dep:
            out.append(dep)
    return out


def _digest(parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _host_compiler(flags: list[str]) -> str:
    for i, flag in enumerate(flags):
        if flag in ("-ccbin", "--compiler-bindir") and i + 1 < len(flags):
            return flags[i + 1]
        for prefix in ("-ccbin=", "--compiler-bindir="):
            if flag.startswith(prefix):
                return flag[len(prefix) :]
    return os.environ.get("NVCC_CCBIN") or "gcc"


def _stdout(command: list[str]) -> str:
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {run.stderr.strip()}")
    return run.stdout


def toolchain_versions(nvcc: str, flags: list[str]) -> str:
    """nvcc's full version text and the host compiler's version line."""
    host = _host_compiler(flags)
    return (
        _stdout([nvcc, "--version"]).strip()
        + "\n"
        + _stdout([host, "--version"]).splitlines()[0].strip()
    )


def portable_flags(flags: list[str], source: str) -> list[str]:
    """The compile flags without include directories and the source path: where the files
    are differs between machines; what they hold is in the keys."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            continue
        if flag in ("-I", "-isystem", "--include-path", "--system-include"):
            skip = True
            continue
        if flag.startswith(("-I", "-isystem", "--include-path=", "--system-include=")):
            continue
        if flag == source:
            continue
        out.append(flag)
    return out


def probe_keys(nvcc, flags, source, arch, roots, versions) -> tuple[str, str]:
    """(source key, toolchain key) of the probe of `source` for `arch` (see the docstring)."""
    arch_flags = ["-cubin", f"-arch=sm_{arch}"]
    run = subprocess.run([nvcc, "-M", *arch_flags, *flags, source], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"nvcc -M {source} (sm_{arch}) failed:\n{run.stderr}")
    deps = make_dependencies(run.stdout)
    if not deps or os.path.realpath(deps[0]) != os.path.realpath(source):
        raise SystemExit(f"nvcc -M {source}: unexpected output {run.stdout[:200]!r}")
    real_roots = [os.path.realpath(r) + os.sep for r in roots]
    project, toolchain = [], []
    for dep in deps:
        real = os.path.realpath(dep)
        (project if real.startswith(tuple(real_roots)) else toolchain).append(_file_digest(real))
    env = [f"{k}={os.environ.get(k, '')}" for k in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")]
    source_key = _digest(["probe-source-1", *arch_flags, *portable_flags(flags, source), *project])
    toolchain_key = _digest(["probe-toolchain-1", versions, *env, *toolchain])
    return source_key, toolchain_key


def compile_probe(nvcc, flags, source, arch, cubin, parse) -> dict:
    run = subprocess.run(
        [nvcc, "-cubin", f"-arch=sm_{arch}", *flags, "-o", cubin, source],
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise SystemExit(f"probe compile of {source} for sm_{arch} failed:\n{run.stderr}")
    with open(cubin, "rb") as f:
        table = kernel_registers(cubin_registers(f.read()), parse)
    if not table:
        raise SystemExit(f"{cubin}: no fused all-reduce kernel found")
    return table


def read_cache(path: str) -> dict:
    """{name.sm_arch: [entry, ...]}: one entry per toolchain (see `store`)."""
    try:
        with open(path) as f:
            return json.load(f)["entries"]
    except FileNotFoundError:
        return {}


def write_cache(path: str, entries: dict) -> None:
    """One entry per line, so that a change reads as a change of its lines."""
    lines = ["{", f'"about": {json.dumps(CACHE_ABOUT)},', '"entries": {']
    names = sorted(entries)
    for i, name in enumerate(names):
        lines.append(f"{json.dumps(name)}: [")
        for j, entry in enumerate(entries[name]):
            comma = "," if j + 1 < len(entries[name]) else ""
            lines.append(json.dumps(entry, sort_keys=True, separators=(",", ":")) + comma)
        lines.append("]" + ("," if i + 1 < len(names) else ""))
    lines += ["}", "}", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def probe(args: argparse.Namespace) -> int:
    if len(args.compile) < 2:
        raise SystemExit("probe: give the compile command after --: NVCC FLAGS... SOURCE")
    nvcc, *flags, source = args.compile
    if len({arch_number(a) for a in args.arch}) != len(args.arch):
        raise SystemExit(f"an architecture is given twice: {args.arch}")
    parse = parse_moe_kernel if args.moe else parse_kernel
    stem = tu_name(args.moe, args.dtype, args.nranks)
    cache = read_cache(args.cache)
    versions = toolchain_versions(nvcc, flags)
    work_dir = args.work_dir or os.path.dirname(os.path.abspath(args.out))

    def one(arch: str) -> dict:
        name = f"{stem}.sm_{arch}"
        source_key, toolchain_key = probe_keys(
            nvcc, flags, source, arch, args.project_root, versions
        )
        cached = next(
            (
                e
                for e in cache.get(name, [])
                if e["source"] == source_key and e["toolchain"] == toolchain_key
            ),
            None,
        )
        entry = {
            "source": source_key,
            "toolchain": toolchain_key,
            "toolchain_versions": versions,
        }
        if cached is not None and not args.verify:
            return {**entry, "kernels": cached["kernels"], "from": "cache"}
        cubin = os.path.join(work_dir, f"{name}.cubin")
        rows = table_rows(compile_probe(nvcc, flags, source, arch, cubin, parse))
        if cached is not None and cached["kernels"] != rows:
            raise SystemExit(
                f"{name}: the register cache {args.cache} disagrees with the probe compiled "
                "from the same input: the cache key misses an input"
            )
        verified = " (verified: the cache holds the same counts)" if cached else ""
        return {**entry, "kernels": rows, "from": "probe" + verified}

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(args.arch)) as pool:
        results = dict(zip(args.arch, pool.map(one, args.arch)))
    by_arch = {
        arch_number(arch): table_from_rows(r["kernels"], args.moe, args.dtype, args.nranks)
        for arch, r in results.items()
    }
    text = (moe_header_text if args.moe else header_text)(args.dtype, args.nranks, by_arch)
    record = {f"{stem}.sm_{arch}": r for arch, r in results.items()}
    with open(args.record, "w") as f:
        json.dump({"entries": record}, f, sort_keys=True)
    for name, r in sorted(record.items()):
        if r["from"] == "probe":
            print(
                f"{name}: compiled the probe (not in {os.path.basename(args.cache)} for this "
                "input; tools/launch_registers.py store --build-dir BUILD stores it)"
            )
    write_if_changed(args.out, text)
    return 0


def read_records(build_dir: str, moe: bool) -> dict:
    """{name.sm_arch: entry} of the probe records in a build tree."""
    pattern = ("moe_" if moe else "") + "unhooked_*.registers.json"
    out = {}
    for path in sorted(glob.glob(os.path.join(build_dir, "**", pattern), recursive=True)):
        with open(path) as f:
            out.update(json.load(f)["entries"])
    return out


def store(args: argparse.Namespace) -> int:
    """Adds the build's compiled counts to the cache: per name, the entry of the same
    toolchain is replaced, and entries of other sources (older kernels) are dropped."""
    records = {**read_records(args.build_dir, False), **read_records(args.build_dir, True)}
    if not records:
        raise SystemExit(f"no probe records (*unhooked_*.registers.json) under {args.build_dir}")
    cache = read_cache(args.cache)
    stored = 0
    for name, record in sorted(records.items()):
        if not record["from"].startswith("probe"):
            continue
        entry = {k: record[k] for k in ("source", "toolchain", "toolchain_versions", "kernels")}
        kept = [
            e
            for e in cache.get(name, [])
            if e["source"] == entry["source"] and e["toolchain"] != entry["toolchain"]
        ]
        if entry not in cache.get(name, []):
            stored += 1
        cache[name] = [*kept, entry]
    write_cache(args.cache, cache)
    print(f"{args.cache}: {stored} new entries of {len(records)} probe records")
    return 0


_RECORD_NAME = re.compile(r"unhooked_(f32|f16|bf16)_n(\d+)\.sm_(\w+)$")


def read_probe_tables(build_dir: str, moe: bool):
    """The unhooked register tables of a build (its probe records: from the cache or from
    compiled probes), per translation unit {(dtype, nranks): {arch: table}} and per
    architecture {arch: table}."""
    per_tu: dict = {}
    probes: dict = {}
    for name, record in read_records(build_dir, moe).items():
        m = _RECORD_NAME.search(name)
        if not m:
            raise SystemExit(f"{build_dir}: unexpected probe record {name!r}")
        dtype, nranks = DTYPE_NAMES.index(m.group(1)), int(m.group(2))
        arch = arch_number(m.group(3))
        table = table_from_rows(record["kernels"], moe, dtype, nranks)
        per_tu.setdefault((dtype, nranks), {})[arch] = table
        probes.setdefault(arch, {}).update(table)
    return per_tu, probes


def stale_headers(build_dir: str, per_tu: dict, prefix: str, text) -> list[str]:
    """Where a generated header in the build tree (`prefix`_<dtype>_n<ranks>.h) is not what
    `text`(dtype, nranks, by_arch) makes of its probe records: the library was compiled with
    other counts than the records give."""
    problems = []
    for (dtype, nranks), by_arch in sorted(per_tu.items()):
        name = f"{prefix}_{DTYPE_NAMES[dtype]}_n{nranks}.h"
        found = glob.glob(os.path.join(build_dir, "**", name), recursive=True)
        if len(found) != 1:
            problems.append(f"{name}: expected one in the build tree, found {len(found)}")
            continue
        with open(found[0]) as f:
            if f.read() != text(dtype, nranks, by_arch):
                problems.append(f"{found[0]} is not what the probe records give (stale build?)")
    return problems


def check(args: argparse.Namespace) -> int:
    per_tu, probes = read_probe_tables(args.build_dir, moe=False)
    if not per_tu:
        raise SystemExit(f"no probe records (unhooked_*.registers.json) under {args.build_dir}")
    # 1. The headers the library was compiled with hold exactly the probe counts.
    problems = stale_headers(args.build_dir, per_tu, "unhooked_registers", header_text)
    # 2. The library's hooked kernels: the same set, and none allocates more registers.
    cuobjdump = find_cuobjdump(args.cuobjdump)
    if cuobjdump is None:
        raise SystemExit("cuobjdump not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump)")
    hooked = library_registers(args.core, cuobjdump)
    if sorted(hooked) != sorted(probes):
        problems.append(f"architectures: library {sorted(hooked)}, probes {sorted(probes)}")
    rows = []
    moved = 0
    for arch in sorted(probes):
        lib = hooked.get(arch, {})
        if set(lib) != set(probes[arch]):
            missing = sorted(set(probes[arch]) - set(lib))
            extra = sorted(set(lib) - set(probes[arch]))
            problems.append(
                f"sm_{arch}: kernels only unhooked {len(missing)}, only hooked "
                f"{len(extra)}: {[k.describe() for k in (missing + extra)[:4]]}"
            )
        for kernel in sorted(set(lib) & set(probes[arch])):
            unhooked, mine = probes[arch][kernel], lib[kernel]
            if allocated(mine) > allocated(unhooked):
                problems.append(
                    f"sm_{arch} {kernel.describe()}: hooked {mine} registers "
                    f"allocate more than unhooked {unhooked}"
                )
            geometry = []
            for tokens, hidden in GEOMETRY_SHAPES:
                shape = dict(
                    hidden_dim=hidden,
                    tokens=tokens,
                    elem_bytes=4 if kernel.dtype == 0 else 2,
                    nranks=kernel.nranks,
                    oneshot=kernel.kind != 2,
                )
                if shape["oneshot"] != (tokens <= ONESHOT_MAX_TOKENS):
                    continue
                pinned = flashinfer_geometry(unhooked, **shape)
                unpinned = flashinfer_geometry(mine, **shape)
                moved += pinned != unpinned
                geometry.append(
                    f"{tokens}x{hidden}:{pinned[0]}/{pinned[1]}"
                    + ("" if pinned == unpinned else f"(unpinned {unpinned[0]}/{unpinned[1]})")
                )
            rows.append(
                f"sm_{arch} {kernel.describe()}  unhooked {unhooked:3d}  hooked {mine:3d}  "
                + " ".join(geometry)
            )
    moe_problems, moe_counts = check_moe(args.build_dir, args.core, cuobjdump, args.verbose)
    problems += moe_problems
    counts = {arch: len(t) for arch, t in sorted(probes.items())}
    differ = sum(probes[a][k] != hooked.get(a, {}).get(k) for a in probes for k in probes[a])
    if args.verbose:
        print("\n".join(rows))
    print(f"MoE kernels per architecture {moe_counts}; none allocates more registers hooked")
    print(
        f"kernels per architecture {counts}; register counts that differ hooked vs unhooked: "
        f"{differ}; launch geometries (threads/cluster) at {len(GEOMETRY_SHAPES)} shapes that the "
        f"hooked counts would move without the pin: {moved}"
    )
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print("launch geometry: every hooked kernel launches as the unhooked one; all fit")
    return 0


def check_moe(build_dir: str, core: str, cuobjdump: str, verbose: bool):
    """The MoE kernels: the generated headers hold exactly the unhooked counts, the library has
    the same kernels, and no hooked one allocates more registers than its unhooked twin."""
    per_tu, probes = read_probe_tables(build_dir, moe=True)
    if not probes:
        return [f"no MoE probe records (moe_unhooked_*.registers.json) under {build_dir}"], {}
    problems = stale_headers(build_dir, per_tu, "moe_unhooked_registers", moe_header_text)
    hooked = library_registers(core, cuobjdump, parse_moe_kernel)
    for arch in sorted(probes):
        lib = hooked.get(arch, {})
        if set(lib) != set(probes[arch]):
            problems.append(
                f"sm_{arch}: the library's MoE kernels are not the probes' "
                f"({len(lib)} vs {len(probes[arch])})"
            )
        for kernel in sorted(set(lib) & set(probes[arch])):
            unhooked, mine = probes[arch][kernel], lib[kernel]
            if allocated(mine) > allocated(unhooked):
                problems.append(
                    f"sm_{arch} {kernel.describe()}: hooked {mine} registers "
                    f"allocate more than unhooked {unhooked}"
                )
            if verbose:
                print(f"sm_{arch} {kernel.describe()}  unhooked {unhooked:3d}  hooked {mine:3d}")
    return problems, {arch: len(t) for arch, t in sorted(probes.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--dtype", type=int, required=True, choices=(0, 1, 2))
    pr.add_argument("--nranks", type=int, required=True)
    pr.add_argument("--moe", action="store_true")
    pr.add_argument("--out", required=True, help="the header to write")
    pr.add_argument("--cache", required=True, help="ffi/core/unhooked_registers.json")
    pr.add_argument("--record", required=True, help="where to write what was used (JSON)")
    pr.add_argument("--arch", action="append", required=True, help="90a, 100a, ...")
    pr.add_argument(
        "--project-root",
        action="append",
        default=[],
        help="a tree whose files count as the project's (the source and build trees)",
    )
    pr.add_argument("--work-dir", help="where probe cubins go (default: the header's folder)")
    pr.add_argument(
        "--verify", action="store_true", help="compile even on a cache hit, and compare"
    )
    pr.add_argument("compile", nargs="+", metavar="NVCC FLAGS... SOURCE")
    st = sub.add_parser("store")
    st.add_argument("--build-dir", required=True)
    st.add_argument(
        "--cache",
        default=os.path.normpath(
            os.path.join(os.path.dirname(__file__), "..", "ffi", "core", "unhooked_registers.json")
        ),
        help="the cache to add to (default: the repository's)",
    )
    c = sub.add_parser("check")
    c.add_argument("--core", required=True)
    c.add_argument("--build-dir", required=True)
    c.add_argument("--cuobjdump")
    c.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    commands = {"probe": probe, "store": store, "check": check}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
