#!/usr/bin/env bash
# One prepared check for a lent NVIDIA GPU (an H200 here); needs no network. Runs the
# kernel tests on CUDA, the end-to-end greedy check against transformers on the GPU,
# and the attention microbenchmarks; writes everything to $OUT (or bench/results/gpu).
# Usage, from the repository root: bash bench/gpu_check.sh   (at most 7.5 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/gpu}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONPATH="$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  "$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$out/device.txt" 2>&1
status=0
timeout 240 "$python" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py \
  2>&1 | tee "$out/tests.txt" || status=1
timeout 200 "$python" bench/gpu_bench.py --out "$out/attention.md" 2>&1 | tee "$out/bench.txt" || status=1
exit $status
