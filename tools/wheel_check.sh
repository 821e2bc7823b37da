#!/usr/bin/env bash
# Checks a jax_fusedar wheel as a user without a CUDA toolkit would get it (CI runs this
# on the wheel tools/build_wheel.sh made from the core ./dev test built):
#
#   tools/wheel_check.sh WHEEL
#
# 1. contents: only the two packages (and the wheel's metadata, auditwheel's .libs), no
#    benchmark, tools or tests code (tools/wheel_contents.py); the kernel library holds an
#    sm_90a and an sm_100a ELF (cuobjdump --list-elf; from the CUDA toolkit, else the
#    nvidia-cuda-cuobjdump package);
# 2. a fresh venv with the wheel and its [jax] extra only (plus pytest), used with a PATH
#    without nvcc and no CUDACXX/CUDA_HOME, from a folder outside the checkout:
#    tools/wheel_smoke.py (imports from the venv, the native module loads, the op on 8
#    CPU devices against a float64 oracle, the cuda lowering's custom call) and the JAX
#    API's CPU tests (results, cuda lowering), none of which may be skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
wheel=$(realpath "$1")
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS

echo "== contents of $(basename "$wheel")"
"$py" tools/wheel_contents.py "$wheel"
cuobjdump=$(command -v cuobjdump || true)
for dir in "${CUDA_HOME:-}" /usr/local/cuda; do
  if [ -z "$cuobjdump" ] && [ -n "$dir" ] && [ -x "$dir/bin/cuobjdump" ]; then
    cuobjdump=$dir/bin/cuobjdump
  fi
done
if [ -z "$cuobjdump" ]; then
  "$py" -m venv "$work/cuobjdump"
  "$work/cuobjdump/bin/python" -m pip install -q --disable-pip-version-check "nvidia-cuda-cuobjdump>=13"
  cuobjdump=$(ls "$work"/cuobjdump/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump)
fi
"$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("jax_fusedar/libfusedar_core.so", sys.argv[2])' \
  "$wheel" "$work/unpacked"
"$cuobjdump" --list-elf "$work/unpacked/jax_fusedar/libfusedar_core.so" > "$work/elf.txt"
for arch in sm_90a sm_100a; do
  n=$(grep -c "\.$arch\.cubin" "$work/elf.txt" || true)
  if [ "$n" -eq 0 ]; then
    echo "wheel_check: no $arch kernels in libfusedar_core.so; cuobjdump --list-elf says:" >&2
    cat "$work/elf.txt" >&2
    exit 1
  fi
  echo "$arch: $n ELF images"
done

echo "== fresh venv: the wheel with its [jax] extra"
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel[jax]" "pytest>=8"
# The JAX API's CPU tests, copied out of the checkout so nothing can import from it.
mkdir -p "$work/run"
cp tools/wheel_smoke.py "$work/run/"
cp -r tests "$work/run/tests"
api_tests=tests/jax/test_api.py
[ -f "$work/run/$api_tests" ] || { echo "wheel_check: $api_tests was not found" >&2; exit 1; }
no_cuda_path=$work/venv/bin:/usr/bin:/bin
if PATH=$no_cuda_path command -v nvcc >/dev/null; then
  echo "wheel_check: nvcc is still on $no_cuda_path" >&2; exit 1
fi
cd "$work/run"
env -u CUDACXX -u CUDA_HOME -u PYTHONPATH PATH="$no_cuda_path" python wheel_smoke.py
env -u CUDACXX -u CUDA_HOME -u PYTHONPATH PATH="$no_cuda_path" \
  python -m pytest -q -p no:cacheprovider -rs $api_tests | tee "$work/pytest.log"
if grep -Eq "[0-9]+ skipped" "$work/pytest.log"; then
  echo "wheel_check: tests were skipped: the installed wheel must run them all" >&2; exit 1
fi
cd "$repo"
echo "wheel_check: passed in $((SECONDS - start)) s"
