#!/usr/bin/env bash
# Install the optional SGLang backend (backend="sglang") into the project venv .venv.
#
# On a machine with CUDA, `pip install -e '.[sglang]'` in the checkout is the ordinary route. A
# plain `pip install sglang` is not workable on a CPU-only machine (it pins a CUDA
# torch and ~1.6 GB of CUDA-only packages; sglang-kernel does not import without
# libcuda), so this script takes the measured route: keep the venv's CPU torch, install
# sglang==0.5.23 without its dependencies, then the packages its imports need, pinned.
# pip may print version-conflict warnings for sglang's CUDA pins; they are expected.
#
# Two import-only stand-ins ship in omni_async/backends/sglang/shims/ and are put on
# the venv's path by a .pth file: torchvision (PyPI's build does not load beside a CPU
# torch, and sglang imports it in multimodal helpers) and vllm._custom_ops (imported by
# sglang's rotary embedding on non-CUDA platforms; the native forward is what runs).
# They are served only to sglang's imports and only when the real package is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
if [ ! -x .venv/bin/python ]; then
  bash scripts/setup.sh
fi
PY=.venv/bin/python

"$PY" -m pip install -q --no-deps "sglang==0.5.23"
"$PY" -m pip install -q \
  "orjson==3.13.0" "psutil==7.2.2" "pybase64==1.5.1" "requests==2.34.2" "triton==3.8.0" \
  "pillow==13.0.0" "starlette==1.10.0" "fastapi==0.165.0" "msgspec==0.23.0" "pyzmq==27.3.0" \
  "ipython==9.18.1" "aiohttp==3.14.5" "huggingface_hub==1.33.0" "setproctitle==1.3.8" \
  "apache-tvm-ffi==0.1.11" "transformers==5.19.0" "dill==0.4.1" "sentencepiece==0.2.1" \
  "compressed-tensors==0.18.0" "gguf==0.19.0" "openai==2.8.0" "partial_json_parser==0.2.1.1.post7" \
  "einops==0.8.2" "uvicorn==0.54.0" "xgrammar==0.2.7" tqdm uvloop

SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$SITE/omni_async_sglang_shims.pth" <<PTH
$ROOT/omni_async/backends/sglang/shims
import omni_sglang_shims
PTH

# Fail here, not in the tests, when the install does not import.
"$PY" - <<'PY'
import time
t = time.time()
from omni_async.backends.sglang import require_sglang, sglang_version
require_sglang()
import sglang.srt.managers.tp_worker  # noqa: F401  (the model worker's import tree)
print(f"sglang {sglang_version()} imports in .venv ({time.time() - t:.1f}s)")
PY
