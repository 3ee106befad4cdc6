#!/usr/bin/env bash
# One batched GPU session: the CUDA-only tests, then the benchmarks named in $BENCHES
# (default: prefix cache and the saturation workload), results under $OUT.
# Usage on the GPU machine: OUT=/some/dir bash scripts/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/omni-gpu}
BENCHES=${BENCHES:-"prefix saturation"}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_prefix_cache.py tests/test_fused_cuda.py tests/test_device_wait.py tests/test_host_path.py 2>&1 | tail -4 | tee "$OUT/cuda_tests.txt"
for b in $BENCHES; do
  case $b in
    prefix) timeout "${PREFIX_TIMEOUT:-260}" python3 bench/prefix_cache.py --out "$OUT/prefix_cache_h200.json" --repeats 3 2>&1 | tail -25 ;;
    saturation) timeout "${SAT_TIMEOUT:-240}" python3 bench/gpu_saturation.py --out "$OUT/gpu_saturation_h200.json" \
      --sections "${SAT_SECTIONS:-w256}" --gc default,tuned --repeats 3 2>&1 | grep -v '^{' | tail -40 ;;
    extend) timeout 200 python3 tools/extend_kernel.py --out "$OUT/extend_kernel_h200.json" --repeats 3 2>&1 | tail -16 ;;
  esac
done
