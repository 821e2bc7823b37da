#!/usr/bin/env bash
# The linters: pre-commit runs the hooks of .pre-commit-config.yaml (ruff format, ruff check,
# clang-format; pinned there) over every tracked file. CI runs this first, before the build:
#
#   tools/lint.sh         format (ruff, clang-format) and report ruff's findings; exit 1 when
#                         a formatter changed a file (the diff is shown) or a finding is left
#   tools/lint.sh --fix   the same, with ruff's safe fixes applied
#
# pre-commit itself, pinned, lives in a venv of its own (not the project's), made once; the
# hooks' environments in pre-commit's cache ($PRE_COMMIT_HOME, else ~/.cache/pre-commit),
# which outlives a clean clone as pip's cache does.
set -euo pipefail
cd "$(dirname "$0")/.."
PRE_COMMIT=pre-commit==4.7.0
venv=${JAX_FUSEDAR_LINT_VENV:-build/lint-venv}
if [ "$(cat "$venv/.pins" 2>/dev/null)" != "$PRE_COMMIT" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$PRE_COMMIT"
  echo "$PRE_COMMIT" > "$venv/.pins"
fi
stage=pre-commit
case "${1:-}" in
  "") ;;
  --fix) stage=manual ;;
  *) echo "tools/lint.sh: unknown argument $1 (see the header)" >&2; exit 2 ;;
esac
exec "$venv/bin/pre-commit" run \
  --all-files --hook-stage "$stage" --show-diff-on-failure --color never
