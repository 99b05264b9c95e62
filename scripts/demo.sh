#!/usr/bin/env bash
# The main job on its offline default: set up a virtual environment (once) and run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check -e '.[mistral]'
exec contextkeeper demo "$@"
