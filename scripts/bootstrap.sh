#!/usr/bin/env bash
# Set up EgoMem from nothing, idempotently: a virtualenv at .venv/ in the checkout with the project
# (editable) and its test tools. A second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=""
for cand in python3.11 python3.12 python3.13 python3; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    PY=$cand; break
  fi
done
[ -n "$PY" ] || { echo "bootstrap: EgoMem needs Python >= 3.11 (none found on PATH)" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi

stamp=.venv/.egomem-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing egomem and its dependencies into .venv (first time: a few minutes, ~8 GB)"
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
