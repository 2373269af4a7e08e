"""readers="node" across two real launches: two torchrun invocations with
different node ranks on loopback, two ranks each; in each launch only local
rank 0 sees the checkpoint. "auto" must pick node mode, each node's reader
must read exactly its own node's shards, and nothing but control messages
may cross between the launches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from streamload.tools.synthetic import make_checkpoint

WORKER = Path(__file__).resolve().parent / "node_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_launches_read_per_node(tmp_path: Path) -> None:
    ckpt = make_checkpoint(
        tmp_path / "ckpt",
        "qwen2",
        tie=True,
        seed=11,
        layers=2,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_shard_size="8KB",
    )
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("STREAMLOAD_NODE", None)
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(WORKER),
                "--ckpt",
                str(ckpt),
                "--out",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    logs = []
    try:
        for p in launches:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in launches:
            p.kill()
    assert all(p.returncode == 0 for p in launches), "\n".join(x[-3000:] for x in logs)
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["node"] for r in res] == ["0", "0", "1", "1"]
    assert res[0]["bad"] == [], res[0]["bad"]
    assert all(r["tied"] for r in res)
    reps = [r["report"] for r in res]
    assert all(r["reader"].startswith("node: 2 nodes") for r in reps), reps[0]["reader"]
    received = reps[0]["bytes_received"]
    assert all(x > 0 for x in received)
    # Only local rank 0 of each launch read, and each read exactly its own node's shards.
    assert reps[1]["bytes_read"] == reps[3]["bytes_read"] == 0
    assert reps[0]["bytes_read"] + reps[0]["bytes_mapped"] == received[0] + received[1]
    assert reps[2]["bytes_read"] + reps[2]["bytes_mapped"] == received[2] + received[3]
    # What crossed a transport went from a node's reader to its own node's other rank.
    assert reps[0]["bytes_sent"] == received[1] + received[3]
