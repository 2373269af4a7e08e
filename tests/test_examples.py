"""The integration examples run as written (torchrun, 2 CPU ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
OK = "OK: every parameter equals transformers' from_pretrained; tie held: True"
TORCH_EXIT_ABORT = "terminate called without an active exception"


@pytest.mark.parametrize(
    "script,extra",
    [
        ("verl_fsdp2.py", []),
        ("accelerate_fsdp2.py", []),
        ("areal_memory_efficient_load.py", []),
        ("torchtitan_hf_load.py", ["--model-type", "qwen3_moe"]),
    ],
)
def test_example_runs(script: str, extra: list[str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / script),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=EXAMPLES.parent)
    if r.returncode != 0 and OK in r.stdout and TORCH_EXIT_ABORT in r.stderr:
        # torch 2.13 (CPU, gloo, torchrun) sometimes aborts a rank at interpreter exit, after
        # destroy_process_group, with no streamload in the process at all: a plain
        # fully_shard + backward + destroy script did so in 1 of 15 runs here. The example's
        # checks had all passed (OK printed); run it once more, and that run must be clean.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=EXAMPLES.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert OK in r.stdout
