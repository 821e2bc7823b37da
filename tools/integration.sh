#!/usr/bin/env bash
# The integration lane: jax_fusedar.fuse on models exactly as MaxText, transformers, Flax
# and Equinox publish them (tests/integration/, marker `integration`, docs/testing.md), in a
# venv of its own, made here from the registry with every package pinned
# (tests/integration/requirements.txt under constraints.txt):
#
#   tools/integration.sh [PYTEST_ARGS]   the lane's tests (pytest -m integration)
#   tools/integration.sh table [ARGS]    print the lane's table for docs/fusion_pass.md
#
# MaxText needs Python >= 3.12 (this project's machines run 3.11): the venv is made with
# $INTEGRATION_PYTHON, else the first python3.13 / python3.12 on PATH, else pyenv's newest
# installed 3.12+ (its shims answer only for the selected version). The venv is
# .venv-integration ($INTEGRATION_VENV), remade when the pins change.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${INTEGRATION_VENV:-.venv-integration}
req=tests/integration/requirements.txt
pins=tests/integration/constraints.txt

find_python() {
  local p pyenv_pythons=()
  if command -v pyenv >/dev/null 2>&1; then
    mapfile -t pyenv_pythons < <(ls -d "$(pyenv root)"/versions/3.1[2-9]*/bin/python3 \
                                   2>/dev/null | sort -rV)
  fi
  for p in ${INTEGRATION_PYTHON:-} python3.13 python3.12 "${pyenv_pythons[@]}"; do
    if command -v "$p" >/dev/null 2>&1 &&
       "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$p"; return
    fi
  done
}

stamp="$venv/.pins"
want=$(cat "$req" "$pins" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  started=$SECONDS
  python=$(find_python)
  if [ -z "$python" ]; then
    echo "tools/integration.sh: MaxText needs Python >= 3.12 and none was found (python3.12 or" \
         "python3.13 on PATH, pyenv's versions); set INTEGRATION_PYTHON=/path/to/python3.12" >&2
    exit 2
  fi
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req" -c "$pins"
  echo "$want" > "$stamp"
  echo "tools/integration.sh: set up $venv in $((SECONDS - started)) s" >&2
fi
export JAX_PLATFORMS=cpu
if [ "${1:-}" = table ]; then
  shift
  exec "$venv/bin/python" -m tests.integration.table "$@"
fi
started=$SECONDS
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m integration tests/integration "$@"
rc=$?
echo "tools/integration.sh: the lane took $((SECONDS - started)) s" >&2
if [ $rc -eq 5 ]; then echo "no tests were collected" >&2; fi
exit $rc
