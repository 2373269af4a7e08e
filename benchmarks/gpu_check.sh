#!/usr/bin/env bash
# The GPU check, in one run on a fresh machine with one CUDA GPU (under 5 minutes):
#  - deps: the build and test dependencies (scikit-build-core, pybind11, cmake, ninja, numpy,
#    tqdm, psutil, safetensors, transformers, accelerate, pytest) are looked for first; the
#    missing ones are installed with pip under a constraint that pins the installed torch, so
#    pip never replaces the CUDA build;
#  - build: the package, in place (pip install --no-build-isolation --no-deps -e .);
#  - gpu_tests: tests/test_gpu.py on one NCCL rank (bit-exact src and owners loads, nothing
#    left allocated, pinned or grouped, no empty_cache, FSDP2 CPU offload materialised on the
#    CPU, verl's cpu_offload returning finished copies, a save round trip against
#    transformers' bytes, the multi-rank paths forced on one rank);
#  - gpu_tests_multi_rank: the same tests with STREAMLOAD_FORCE_MULTI_RANK=1 (docs/options.md):
#    the group of one takes the paths of many (NCCL all_to_all with its waits, the gloo side
#    group, the object gathers, the meeting, the save's writers), which one GPU runs no other way;
#  - bench: benchmarks/bench_gpu.py on a 2 GB checkpoint (owners loads compared byte for byte
#    with safetensors; GB/s against safetensors.torch.load_file(device="cuda") and pinned
#    host-to-device copies; 5 reloads that must not grow memory, pinned bytes or process
#    groups; bucket sizes 32-512 MiB), given whatever time is left, and run even when a test
#    failed.
# A failing check never stops the ones after it. Each prints one summary line
#   gpu_check | <check> | PASS|FAIL|SKIP | <seconds> s | <detail>
# at the end (and into OUT_DIR/summary.txt), then a "total" line; the exit status is non-zero
# when any check failed or the whole run took more than 300 s (GPU_CHECK_LIMIT).
#
# --dry-run: on a CPU-only machine, everything a fake can stand in for: the dependency check
# (nothing installed), the world-1 multi-rank paths on one gloo rank (tests/test_world1_paths.py),
# the fake-device tests (tests/test_gpu_path.py, test_gpu_faults.py, test_host_shards.py,
# test_nan_casts.py, test_missing_init.py) and the NCCL-refuses-CPU fake
# (tests/test_cpu_wire.py); the build, the GPU tests and the bench are SKIP lines.
#
# The interpreter: $PYTHON, else the first of .venv/bin/python, python, python3 that imports
# torch (else the first that exists).
#
#   bash benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
OUT_ARG=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h | --help)
            sed -n '2,/^set -uo/p' "$0" | sed '$d'
            exit 0
            ;;
        -*)
            echo "gpu_check: unknown option $arg (see --help)" >&2
            exit 2
            ;;
        *) OUT_ARG="$arg" ;;
    esac
done
if [ "$DRY" = 1 ]; then
    OUT="${OUT_ARG:-${OUT:-bench_out/gpu_dry}}"
else
    OUT="${OUT_ARG:-${OUT:-bench_out/gpu}}"
fi
LIMIT="${GPU_CHECK_LIMIT:-300}"
mkdir -p "$OUT"
: >"$OUT/summary.txt"
export PYTHONUNBUFFERED=1
START=$SECONDS
FAILED=()
LINES=()

pick_python() {
    local candidates=() c
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
        return
    fi
    for c in .venv/bin/python python python3; do
        command -v "$c" >/dev/null 2>&1 && candidates+=("$c")
    done
    for c in "${candidates[@]}"; do
        if "$c" -c "import torch" >/dev/null 2>&1; then
            echo "$c"
            return
        fi
    done
    echo "${candidates[0]:-python3}"
}
PY="$(pick_python)"

# record CHECK STATUS SECONDS DETAIL: one summary line, kept for the end.
record() {
    local line
    line="$(printf 'gpu_check | %-20s | %-4s | %4d s | %s' "$1" "$2" "$3" "$4")"
    LINES+=("$line")
    echo "$line" >>"$OUT/summary.txt"
    echo ">>> $line"
    if [ "$2" = FAIL ]; then FAILED+=("$1"); fi
}

# run CHECK TIMEOUT_S CMD...: runs CMD (output to the console and OUT/CHECK.txt) under a time
# limit (TIMEOUT_S, or less: the run's time left minus RESERVE); sets RC and TOOK (seconds).
RESERVE=0
if [ "$DRY" != 1 ]; then RESERVE=120; fi # the GPU tests and the bench keep this much of the loan
run() {
    local name="$1" limit="$2" t0=$SECONDS cap
    shift 2
    # Never past the whole run's limit: what is left, less what the bench is kept (RESERVE).
    cap=$(($(left) - RESERVE))
    if [ "$cap" -lt 10 ]; then cap=10; fi
    if [ "$limit" -gt "$cap" ]; then limit=$cap; fi
    echo "=== $name: $* (at most ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    RC=${PIPESTATUS[0]}
    TOOK=$((SECONDS - t0))
}

# pytest_check CHECK TIMEOUT_S ARGS...: a pytest run and its summary line.
pytest_check() {
    local name="$1" limit="$2" detail status
    shift 2
    run "$name" "$limit" "$PY" -m pytest -q -p no:cacheprovider "$@"
    detail="$(grep -E '[0-9]+ (passed|failed|skipped|error|errors|deselected)' "$OUT/$name.txt" | tail -1)"
    detail="${detail//=/}"
    detail="$(echo "$detail" | sed 's/^ *//; s/ *$//')"
    status=PASS
    if [ "$RC" -ne 0 ]; then status=FAIL; fi
    if [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then detail="timed out after ${limit} s; ${detail}"; fi
    record "$name" "$status" "$TOOK" "${detail:-no pytest summary (exit $RC)}"
}

left() { echo $((LIMIT - (SECONDS - START))); }

# --- cuda -------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'no torch')"
    record cuda SKIP 0 "dry run ($PY, torch $version): no device needed"
else
    run cuda 60 "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1 || true
    if [ "$RC" -eq 0 ]; then
        record cuda PASS "$TOOK" "$(tail -1 "$OUT/cuda.txt") ($PY)"
    else
        record cuda FAIL "$TOOK" "$(tail -1 "$OUT/cuda.txt") ($PY)"
    fi
fi

# --- deps: look first, install only what is missing, never touching torch ---------------
t0=$SECONDS
missing="$("$PY" - <<'EOF' 2>"$OUT/deps.txt"
import importlib.metadata as md
import importlib.util
import re
import shutil
import subprocess

def version(dist):
    try:
        return tuple(int(x) for x in re.findall(r"\d+", md.version(dist))[:2])
    except md.PackageNotFoundError:
        return None

# pip requirement -> (import name, distribution, minimum (major, minor))
wanted = {
    "scikit-build-core>=0.10": ("scikit_build_core", "scikit-build-core", (0, 10)),
    "pybind11>=2.12": ("pybind11", "pybind11", (2, 12)),
    "numpy": ("numpy", "numpy", None),
    "tqdm": ("tqdm", "tqdm", None),
    "psutil": ("psutil", "psutil", None),
    "safetensors": ("safetensors", "safetensors", None),
    "transformers>=5.0": ("transformers", "transformers", (5, 0)),
    "accelerate": ("accelerate", "accelerate", None),
    "pytest": ("pytest", "pytest", None),
}
missing = []
for req, (mod, dist, least) in wanted.items():
    if importlib.util.find_spec(mod) is None or (least and (version(dist) or (0, 0)) < least):
        missing.append(req)
# cmake (>= 3.18) and ninja: a tool on PATH will do, else their pip wheels.
for tool, least in (("cmake", (3, 18)), ("ninja", None)):
    path = shutil.which(tool)
    ok = path is not None
    if ok and least:
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        ok = tuple(int(x) for x in re.findall(r"\d+", out)[:2]) >= least
    if not ok:
        missing.append(f"{tool}>=3.18" if least else tool)
print(" ".join(missing))
EOF
)"
rc=$?
if [ $rc -ne 0 ]; then
    record deps FAIL $((SECONDS - t0)) "the dependency check failed: $(tail -1 "$OUT/deps.txt")"
elif [ -z "$missing" ]; then
    record deps PASS $((SECONDS - t0)) "all present"
elif [ "$DRY" = 1 ]; then
    record deps SKIP $((SECONDS - t0)) "would install (a dry run installs nothing): $missing"
else
    torch_version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
    if [ -z "$torch_version" ]; then
        record deps FAIL $((SECONDS - t0)) "torch is not installed (install its CUDA build first); missing: $missing"
    else
        # The constraint keeps the installed torch (a CUDA build pip cannot see on PyPI).
        echo "torch==$torch_version" >"$OUT/constraints.txt"
        # shellcheck disable=SC2086 # $missing is a list of requirements
        PIP_BREAK_SYSTEM_PACKAGES=1 run deps_install 240 "$PY" -m pip install -q -c "$OUT/constraints.txt" $missing
        after="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
        if [ "$RC" -eq 0 ] && [ "$after" = "$torch_version" ]; then
            record deps PASS $((SECONDS - t0)) "installed $missing (torch $after kept)"
        else
            record deps FAIL $((SECONDS - t0)) "pip exit $RC installing $missing; torch $torch_version -> ${after:-gone}"
        fi
    fi
fi

# --- build ------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    run import 60 "$PY" -c "import streamload, streamload.io._native as n; print('streamload', streamload.__file__)"
    if [ "$RC" -eq 0 ]; then
        record build SKIP "$TOOK" "dry run: the installed build imports"
    else
        record build FAIL "$TOOK" "dry run: the installed build does not import: $(tail -1 "$OUT/import.txt")"
    fi
else
    # torch is already installed (a CUDA build); --no-deps: pip must never replace it.
    PIP_BREAK_SYSTEM_PACKAGES=1 run build 240 "$PY" -m pip install -q --no-build-isolation --no-deps -e .
    if [ "$RC" -eq 0 ]; then
        record build PASS "$TOOK" "pip install -e . (in place)"
    else
        record build FAIL "$TOOK" "pip exit $RC: $(tail -1 "$OUT/build.txt")"
    fi
fi

# --- tests ------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    pytest_check world1_gloo 180 tests/test_world1_paths.py
    pytest_check fake_device 300 tests/test_gpu_path.py tests/test_gpu_faults.py tests/test_host_shards.py tests/test_nan_casts.py tests/test_missing_init.py
    pytest_check nccl_refuses_cpu 180 tests/test_cpu_wire.py
    record gpu_tests SKIP 0 "needs CUDA (tests/test_gpu.py, tests/test_gpu_faults.py)"
    record gpu_tests_multi_rank SKIP 0 "needs CUDA (tests/test_gpu.py, STREAMLOAD_FORCE_MULTI_RANK=1)"
    record bench SKIP 0 "bench_gpu.py needs CUDA (pinned host-to-device copies, one NCCL rank)"
else
    RESERVE=60 # the bench gets at least this much of the loan
    pytest_check gpu_tests 150 -m gpu tests/test_gpu.py tests/test_gpu_faults.py
    STREAMLOAD_FORCE_MULTI_RANK=1 pytest_check gpu_tests_multi_rank 120 -m gpu tests/test_gpu.py
    # --- bench: whatever time is left (at least 60 s: numbers beat a clean total) ----------
    RESERVE=0
    budget=$(($(left) - 5))
    if [ "$budget" -gt 240 ]; then budget=240; fi
    if [ "$budget" -lt 60 ]; then budget=60; fi
    run bench "$budget" "$PY" benchmarks/bench_gpu.py --gb 2.0 --json "$OUT/gpu_bench.json"
    detail="$(awk '/^(streamload_owners|streamload_src|safetensors_load_file_cuda|pinned_h2d) / {printf "%s%s %s GB/s", sep, $1, $2; sep=", "}' "$OUT/bench.txt")"
    extra="$(grep -E '^(reloads:|MISMATCH|memory or process groups grew)' "$OUT/bench.txt" | tail -1)"
    detail="${detail:-no GB/s printed}${extra:+; $extra}"
    if [ "$RC" -eq 0 ]; then
        record bench PASS "$TOOK" "$detail"
    else
        [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ] && detail="timed out after ${budget} s; $detail"
        record bench FAIL "$TOOK" "exit $RC; $detail"
    fi
fi

# --- summary ----------------------------------------------------------------------------
ELAPSED=$((SECONDS - START))
if [ "$ELAPSED" -gt "$LIMIT" ]; then FAILED+=(time); fi
echo
echo "== gpu_check summary ($([ "$DRY" = 1 ] && echo 'dry run' || echo 'GPU'); files in $OUT)"
for line in "${LINES[@]}"; do echo "$line"; done
if [ "${#FAILED[@]}" -eq 0 ]; then
    total="$(printf 'gpu_check | %-20s | %-4s | %4d s | limit %d s; every check passed or was skipped' total PASS "$ELAPSED" "$LIMIT")"
else
    total="$(printf 'gpu_check | %-20s | %-4s | %4d s | limit %d s; failed: %s' total FAIL "$ELAPSED" "$LIMIT" "${FAILED[*]}")"
fi
echo "$total" | tee -a "$OUT/summary.txt"
[ "${#FAILED[@]}" -eq 0 ]
