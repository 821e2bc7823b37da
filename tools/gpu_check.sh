#!/usr/bin/env bash
# Runs the GPU test suite on a machine with NVIDIA GPUs, using a libfusedar_core.so built
# elsewhere (the CUDA kernels take minutes to compile; the nanobind module is built here,
# against this machine's Python and jaxlib, in seconds).
#
#   tools/gpu_check.sh PREBUILT_CORE [pytest args...]
#
# Logs and JSON reports go to $OUT (or ./gpu_reports). NVLink multicast stays off in
# every process (NCCL_NVLS_ENABLE=0 etc.): see docs/decisions.md.
set -euo pipefail
cd "$(dirname "$0")/.."
core=$(realpath "$1"); shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-gpu_reports}
mkdir -p "$out"
PY=${PYTHON:-python3}
nvidia-smi -L | tee "$out/gpus.txt"
build=${TMPDIR:-/tmp}/jax_fusedar_build
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_FUSEDAR_PREBUILT_CORE="$core" \
  -DPython_EXECUTABLE="$(command -v "$PY")" > "$out/cmake.log" 2>&1 || { cat "$out/cmake.log"; exit 1; }
cmake --build "$build" >> "$out/cmake.log" 2>&1 || { tail -50 "$out/cmake.log"; exit 1; }
cmake --install "$build" --prefix . >> "$out/cmake.log" 2>&1
# The parent pytest process stays off the GPU: each test starts its own rank processes.
JAX_PLATFORMS=cpu JAX_FUSEDAR_REPORT_DIR="$out" PYTHONUNBUFFERED=1 \
  "$PY" -m pytest -m gpu -s -q -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.log"
