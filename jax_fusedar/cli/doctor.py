"""``python -m jax_fusedar doctor``: one screen about this machine, to paste into a bug report
(as ``jax.print_environment_info()`` or ``python -m torch.utils.collect_env`` do).

It prints the versions (Python, jax_fusedar, jax, jaxlib, JAX's CUDA plugin, torch, numpy;
the CUDA driver and the nvcc and FlashInfer headers the kernels were built with), the native
build (loaded or why not, its CUDA architectures from the build record
``jax_fusedar/libfusedar_core.so.json``), the GPUs (name, compute capability, memory), their
peer access and NVLink / PCIe links (``nvidia-smi topo -m``), the backend ``auto`` would pick
for TP 2, 4 and 8, and the ``JAX_FUSEDAR_*`` variables set, each with what is wrong with it.

Works without a GPU, without torch, JAX or the native build: it imports neither framework
(versions come from the installed distributions) and asks the GPU through the native module
and ``nvidia-smi`` where they exist, saying what it could not find.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable, List, Optional

from ..common import backend_choice, environment, native
from . import ranks

BUILD_RECORD = "libfusedar_core.so.json"
WORLDS = (2, 4, 8)
NVIDIA_SMI_TIMEOUT_S = 20


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _installed(dists) -> str:
    found = [f"{d} {v}" for d in dists for v in [_version(d)] if v]
    return ", ".join(found) if found else "not installed"


def _cuda_plugins() -> List[str]:
    """JAX's CUDA plugin distributions installed (jax-cuda12-plugin, jax-cuda13-pjrt, ...)."""
    names = set()
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if re.fullmatch(r"jax-cuda\d+-(plugin|pjrt)", name):
            names.add(name)
    return sorted(names)


def _run(cmd) -> Optional[str]:
    """``cmd``'s stdout, or None when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def build_record(package_dir: Optional[Path] = None) -> Optional[dict]:
    """The native build's record (ffi/core/CMakeLists.txt writes it), or None."""
    package_dir = Path(__file__).resolve().parent.parent if package_dir is None else package_dir
    try:
        return json.loads((package_dir / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _native_lines(record: Optional[dict]) -> List[str]:
    if native.ext is None:
        why = native.unavailable_reason()
        return [
            f"native build: not loaded ({why}): the reference path runs everywhere; build it "
            f"with nvcc on PATH (JAX_FUSEDAR_BUILD_KERNELS=1 ./dev setup, docs/install.md)"
        ]
    where = Path(native.ext.__file__).parent
    if record is None:
        built = f"no build record ({where / BUILD_RECORD}: built before records were kept)"
    else:
        archs = ", ".join(f"sm_{a}" for a in record.get("cuda_archs", [])) or "none recorded"
        built = (
            f"CUDA architectures {archs}; nvcc {record.get('nvcc') or '?'}; FlashInfer headers "
            f"{record.get('flashinfer_headers') or 'of unknown version'}"
        )
    return [f"native build: loaded from {where} (ABI {native.ext.ABI_VERSION}); {built}"]


def _gpus(smi: Callable) -> List[dict]:
    """[{index, name, cc, memory_mib}] from nvidia-smi, else from the native module."""
    out = smi(
        [
            "nvidia-smi",
            "--query-gpu=index,name,compute_cap,memory.total",
            "--format=csv,noheader,nounits",
        ]
    )
    gpus = []
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            gpus.append({"index": int(parts[0]), "name": parts[1], "cc": parts[2], "mib": parts[3]})
    if not gpus and native.gpu_count():
        for i in range(native.gpu_count()):
            major, minor = native.ext.compute_capability(i)
            free, total = native.ext.mem_info(i)
            gpus.append({"index": i, "name": "?", "cc": f"{major}.{minor}", "mib": total >> 20})
    return gpus


def _peer_matrix(n: int) -> Optional[List[str]]:
    """Rows "GPU0  -  Y  Y" of the native module's peer-access answers, or None."""
    if native.ext is None or n < 2 or native.gpu_count() < n:
        return None
    rows = []
    for i in range(n):
        cells = [
            "-" if i == j else ("Y" if native.ext.can_access_peer(i, j) else "N") for j in range(n)
        ]
        rows.append(f"  {f'GPU{i}':<6}" + " ".join(f"{c:>4}" for c in cells))
    return rows


def _links(topo: Optional[str], n: int) -> Optional[List[str]]:
    """The GPU-to-GPU part of ``nvidia-smi topo -m``: one row per GPU, its links to the
    others (NV# = that many NVLinks, PIX/PXB/PHB/NODE/SYS = PCIe paths), or None."""
    if not topo or n < 2:
        return None
    rows = []
    for line in topo.splitlines():
        cells = line.split()
        # A GPU's row starts with its name; the header row (the column names) with a tab.
        if line[:3] == "GPU" and re.fullmatch(r"GPU\d+", cells[0]) and len(cells) > n:
            rows.append(f"  {cells[0]:<6}" + " ".join(f"{c:>4}" for c in cells[1 : n + 1]))
    return rows or None


def auto_backend(world: int, gpus: int, env) -> str:
    """What ``backend="auto"`` gives a TP group of ``world`` ranks in one process or one
    process per rank here, and how those ranks run."""
    on_gpu = gpus > 0 and ranks.jax_sees_gpus(env)
    try:
        name = backend_choice.resolve_backend(None, platform="cuda" if on_gpu else "cpu", env=env)
    except ValueError as e:
        return f"error: {e}"
    if name == "xla" and not on_gpu:
        return "xla (no CUDA GPU for JAX: psum + RMSNorm, the reference path)"
    if name == "xla":
        return f"xla (${backend_choice.BACKEND_ENV_VAR})"
    if native.ext is None:
        return "trtllm, but the native build is missing: creating the workspace fails"
    if gpus >= world:
        return f"trtllm (the kernel), one GPU per rank (GPUs 0-{world - 1})"
    return (
        f"trtllm (the kernel), {world} ranks sharing {gpus} GPU{'s' if gpus > 1 else ''}: the "
        f"demo runs one process per rank, bench refuses"
    )


def _variables(env) -> List[str]:
    set_vars = sorted(v for v in env if v.startswith(environment.PREFIX))
    if not set_vars:
        return ["JAX_FUSEDAR_* variables: none set"]
    lines = ["JAX_FUSEDAR_* variables:"]
    lines += [f"  {v}={env[v]!r}" for v in set_vars]
    lines += [f"  problem: {p}" for p in environment.problems()]
    lines += [f"  unknown: {u}" for u in environment.unknown(env)]
    return lines


def report(env=None, smi: Callable = _run) -> List[str]:
    """The doctor's lines; ``smi`` runs nvidia-smi (a test stands in for it)."""
    env = os.environ if env is None else env
    record = build_record()
    smi_head = smi(["nvidia-smi"]) or ""
    driver = re.search(r"Driver Version:\s*(\S+)", smi_head)
    cuda = re.search(r"CUDA Version:\s*(\S+)", smi_head)
    plugins = _cuda_plugins()
    lines = [
        f"jax_fusedar {_version('jax_fusedar') or 'from a source checkout (not installed)'} "
        f"({Path(__file__).resolve().parent.parent})",
        f"python {platform.python_version()} ({sys.executable}); {platform.platform()}",
        f"jax: {_installed(['jax', 'jaxlib'])}; CUDA plugins: "
        + (_installed(plugins) if plugins else "none"),
        f"torch: {_installed(['torch'])}; numpy: {_installed(['numpy'])}",
        "CUDA driver: "
        + (
            f"{driver.group(1)} (CUDA {cuda.group(1) if cuda else '?'})"
            if driver
            else "not found (no nvidia-smi answered)"
        ),
        *_native_lines(record),
    ]
    gpus = _gpus(smi)
    if gpus:
        lines.append(f"GPUs: {len(gpus)}")
        lines += [f"  GPU{g['index']}: {g['name']}, sm {g['cc']}, {g['mib']} MiB" for g in gpus]
        peers = _peer_matrix(len(gpus))
        if peers:
            lines.append("peer access (the kernel needs it between a TP group's GPUs):")
            lines += peers
        links = _links(smi(["nvidia-smi", "topo", "-m"]), len(gpus))
        if links:
            lines.append("links (nvidia-smi topo -m; NV# = NVLinks, else a PCIe path):")
            lines += links
    else:
        lines.append("GPUs: none visible")
    count = len(gpus) if native.ext is None else max(len(gpus), native.gpu_count())
    lines.append("backend 'auto' for a TP group of:")
    lines += [f"  {w} ranks: {auto_backend(w, count, env)}" for w in WORLDS]
    lines += _variables(env)
    return lines


def main(argv=None) -> int:
    print("\n".join(report()))
    return 0
