#!/usr/bin/env bash
# The whole test suite from a fresh clone: environment, CPU torch, test assets, lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip() { python -m pip -q --disable-pip-version-check "$@"; }
# torch is an extra; a bare requirement would pull a multi-GB CUDA build, so pin the CPU build where none is present.
python -c "import torch" 2>/dev/null || pip install torch==2.13.0
pip install -e '.[all,dev]'
python scripts/fetch_assets.py
ruff check .
ruff format --check .
mypy
python -m pytest -q "$@"
