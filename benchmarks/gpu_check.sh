#!/usr/bin/env bash
# The GPU check, in one run on a machine with one CUDA GPU (about 5 minutes):
# builds the package with the CUDA part, runs the GPU tests (NCCL world size 1,
# CUDA kernels against torch), then prints page-cache -> GPU throughput of a
# >= 2 GB checkpoint against safetensors.torch.load_file(device="cuda") and the
# pinned host-to-device bandwidth measured in the same run.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-bench_out/gpu}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || true
# torch is already installed (a CUDA build); never let pip replace it.
STREAMLOAD_CUDA=ON python -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
python -c "import streamload.io._native as n; m = n.cuda_module(); assert m is not None; print('cuda extension: devices =', m.device_count())"
python -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt"
python benchmarks/bench_gpu.py --gb 2.0 --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
