#!/usr/bin/env bash
# One prepared check for a lent NVIDIA GPU (an H200 here); needs no network. Runs the
# kernel tests on CUDA (paged attention, the fused MoE kernel, the quantized GEMMs and
# LoRA's SGMV against their torch twins), the end-to-end greedy check against transformers on the
# GPU (a dense and an MoE model on the Triton kernels; GPTQ and FP8 block-scaled
# checkpoints against the CPU's tokens),
# a tensor-parallel group of one rank over NCCL (the group machinery on one GPU) against
# the plain runner, and the attention microbenchmarks; writes everything to $OUT (or
# bench/results/gpu). Usage, from the repository root: bash bench/gpu_check.sh
# (at most 8 minutes). Python packages the machine lacks (pydantic-settings, ...) travel
# as wheels (see the device tool's README).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/gpu}"
mkdir -p "$out"
python="${PYTHON:-python3}"
# The services' folders install under the flagstop package (pyproject.toml): an
# editable install maps them without copying (it needs the machine's setuptools).
"$python" -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.txt" 2>&1 \
  || { echo "pip install -e . failed: see $out/install.txt"; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  "$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$out/device.txt" 2>&1
status=0
timeout 240 "$python" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py \
  2>&1 | tee "$out/tests.txt" || status=1
timeout 60 "$python" -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py \
  -k "group_of_one or shards" 2>&1 | tee "$out/tp1.txt" || status=1
timeout 200 "$python" bench/gpu_bench.py --out "$out/attention.md" 2>&1 | tee "$out/bench.txt" || status=1
exit $status
