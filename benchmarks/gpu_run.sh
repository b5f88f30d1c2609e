#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmarks, engine benchmark. Results under $OUT (or ./gpu_out).
# Usage: bash benchmarks/gpu_run.sh [tests|kernels|engine|all] [extra args for engine_bench.py]
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels tests/engine/test_cuda_graph.py 2>&1 \
    | tee "$OUT/tests.log" | tail -25
fi
if [[ $what == kernels || $what == all ]]; then
  python3 benchmarks/kernels.py --only "${KERNEL_GROUPS:-conv,attn,moe,linear,tune}" --out "$OUT/kernels.md" \
    --log "$OUT/kernels_detail.log" 2>&1 | tail -5
fi
if [[ $what == engine || $what == all ]]; then
  python3 benchmarks/engine_bench.py --out "$OUT/engine.md" "$@" 2>&1 | tee "$OUT/engine.log" | tail -40
fi
