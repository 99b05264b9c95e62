#!/usr/bin/env bash
# The whole test suite from a fresh clone: environment, CPU torch, test assets, lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() { echo "== [$((SECONDS - started))s] $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  step "creating .venv"
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip() { python -m pip -q --disable-pip-version-check "$@"; }
# torch is an extra; a bare requirement would pull a multi-GB CUDA build, so pin the CPU build where none is present.
if ! python -c "import torch" 2>/dev/null; then
  step "installing torch 2.13.0 (CPU build)"
  pip install torch==2.13.0
fi
step "installing contextkeeper with its extras (first run: a few minutes)"
pip install -e '.[all,dev]'
step "fetching test assets into .cache/assets (first run: about a minute and a half)"
python scripts/fetch_assets.py --verbose
step "ruff"
ruff check .
ruff format --check .
step "mypy"
mypy
step "pytest (${PYTEST_WORKERS:=2} workers)"
# Two workers: most of the suite waits on servers, sockets and subprocesses, so two cores run it in about half the
# time; PYTEST_WORKERS=0 runs it in this process (as plain `pytest` does).
python -m pytest -q -n "$PYTEST_WORKERS" "$@"
