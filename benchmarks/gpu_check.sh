#!/usr/bin/env bash
# The GPU check, in one run on a machine with one CUDA GPU (under 5 minutes):
#  - builds the package and runs the GPU tests (tests/test_gpu.py: one NCCL rank;
#    bit-exact src and owners loads, nothing left allocated, pinned or grouped,
#    no empty_cache, FSDP2 CPU offload materialised on the CPU, verl's cpu_offload
#    returning finished copies);
#  - benchmarks/bench_gpu.py on a 2 GB checkpoint: readers="owners" 3 times, every
#    byte compared with safetensors; GB/s against safetensors.torch.load_file(device="cuda")
#    and the pinned host-to-device bandwidth, measured in the same run;
#    memory_allocated, torch's pinned host cache, streamload's page-locked bytes and the
#    process-group count after each of 5 reloads (the script fails if any grows);
#    bucket sizes 32-512 MiB for owners and src.
# Everything lands in OUT_DIR (default bench_out/gpu); the exit status is non-zero on
# any failure or when the whole run exceeds 300 s.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-bench_out/gpu}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || true
# torch is already installed (a CUDA build); never let pip replace it.
python -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt"
timeout 240 python benchmarks/bench_gpu.py --gb 2.0 --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
ELAPSED=$((SECONDS - START))
echo "gpu_check: ${ELAPSED} s" | tee -a "$OUT/gpu_bench.txt"
test "$ELAPSED" -le 300
