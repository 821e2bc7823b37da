#!/usr/bin/env bash
# The linters, pinned, over the tracked sources: ruff (check and format; configuration in
# pyproject.toml) for Python, clang-format (.clang-format) for C++ and CUDA. CI runs this
# first, before the build:
#
#   tools/lint.sh          check only: exit 1 on any finding or any file the formatters
#                          would change
#   tools/lint.sh --fix    apply ruff's safe fixes and both formatters in place
#
# The linters live in a venv of their own (not the project's), made once.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF=ruff==0.17.6
CLANG_FORMAT=clang-format==23.1.5
venv=${JAX_FUSEDAR_LINT_VENV:-build/lint-venv}
stamp="$venv/.pins"
if [ "$(cat "$stamp" 2>/dev/null)" != "$RUFF $CLANG_FORMAT" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$RUFF" "$CLANG_FORMAT"
  echo "$RUFF $CLANG_FORMAT" > "$stamp"
fi
mapfile -t cxx < <(git ls-files '*.cc' '*.cpp' '*.h' '*.cu' '*.cuh')
status=0
if [ "${1:-}" = "--fix" ]; then
  # Formatters first, then the linter's fixes; what it cannot fix is listed (exit 1).
  "$venv/bin/ruff" format .
  "$venv/bin/clang-format" -i "${cxx[@]}"
  "$venv/bin/ruff" check --fix . || status=1
else
  "$venv/bin/ruff" check . || status=1
  "$venv/bin/ruff" format --check . || status=1
  "$venv/bin/clang-format" --dry-run --Werror "${cxx[@]}" || status=1
fi
exit $status
