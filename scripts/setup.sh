#!/usr/bin/env bash
# Create .venv and install omni-async with its test and serve extras.
# torch: OMNI_TORCH_SPEC overrides the pin (default torch==2.13.0; on a machine whose
# package index serves a CPU build, that is what you get; elsewhere PyPI's default build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q "${OMNI_TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[test,serve]"
echo "omni-async installed in $(pwd)/.venv"
