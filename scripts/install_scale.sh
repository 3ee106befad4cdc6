#!/usr/bin/env bash
# Install the scale-out extras into the project venv .venv: Ray Serve (extra [ray]:
# `omni-async serve-ray`, omni_async.serving.ray_serve) and SGLang's router (extra [router]:
# the sglang-router binary wheel, in front of `omni-async serve` workers). Both are
# binary wheels for Python 3.11 on x86_64; nothing is compiled. docs/scaling.md says how
# to use them; tests/scale runs them on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  bash scripts/setup.sh
fi
PY=.venv/bin/python
start=$(date +%s)
"$PY" -m pip install -q -e ".[ray,router]" "psutil>=5.9"
# Fail here, not in the tests, when the install does not import.
"$PY" - <<'PY'
import importlib.metadata as md
from ray import serve  # noqa: F401
import sglang_router  # noqa: F401
import omni_async.serving.ray_serve  # noqa: F401
print(f"ray {md.version('ray')} and sglang-router {md.version('sglang-router')} import in .venv")
PY
echo "scale extras installed in $(( $(date +%s) - start )) s"
