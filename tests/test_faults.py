"""Fault injection with 3 ranks launched as separate processes: every rank
raises the named error within 30 s, no process is left running, and the
checkpoint is never written to."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from streamload.tools.synthetic import make_checkpoint

HERE = Path(__file__).parent
WORLD = 3

# fault -> (class raised by the failing rank, class raised by the others, failing rank)
EXPECTED = {
    "truncated_shard": ("HeaderError", "HeaderError", 0),
    "corrupt_header": ("HeaderError", "HeaderError", 0),
    "header_len_beyond_file": ("HeaderError", "HeaderError", 0),
    "missing_tensor": ("KeyMismatchError", "KeyMismatchError", None),
    "wrong_shape_in_config": ("ShapeMismatchError", "ShapeMismatchError", None),
    "index_path_escape": ("UnsafePathError", "UnsafePathError", 0),
    "missing_shard": ("CheckpointFileError", "CheckpointFileError", 0),
    "src_raise_bucket": ("CheckpointFileError", "CheckpointFileError", 0),
    "src_interrupt": ("KeyboardInterrupt", "RemoteRankError", 0),
    "receiver_raise": ("RuntimeError", "RemoteRankError", 2),
    "truncated_while_loading": ("CheckpointFileError", "CheckpointFileError", 0),
    # readers="owners": every rank reads; the same protocol brings one rank's failure to all.
    "owners_raise_bucket": ("CheckpointFileError", "CheckpointFileError", 1),
    "owners_interrupt": ("KeyboardInterrupt", "RemoteRankError", 1),
    "owners_mismatched_copy": ("CheckpointFileError", "CheckpointFileError", None),
    # Steps after the placement all-gather and before the first weight byte (issue #15):
    # a failure on one rank there raises on every rank instead of leaving the others in bucket 0.
    "plan_raise": ("RuntimeError", "RemoteRankError", 1),
    "map_raise": ("CheckpointFileError", "CheckpointFileError", 2),
    "node_groups_raise": ("RuntimeError", "RemoteRankError", 1),
}


def _sha(path: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()
    }


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def _make_cases(root: Path) -> dict[str, Path]:
    base = make_checkpoint(
        root / "base",
        "qwen2",
        tie=True,
        seed=31,
        layers=2,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_shard_size="8KB",
    )
    cases = {}
    for fault in EXPECTED:
        d = root / fault
        shutil.copytree(base, d)
        cases[fault] = d
    f = _shards(cases["truncated_shard"])[1]
    os.truncate(f, f.stat().st_size - 100)
    f = _shards(cases["corrupt_header"])[0]
    data = bytearray(f.read_bytes())
    data[8:24] = b'{"x": {{{{{{{{{{'
    f.write_bytes(bytes(data))
    _shards(cases["missing_shard"])[1].unlink()  # an interrupted download
    f = _shards(cases["header_len_beyond_file"])[0]
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", len(data) + 4096)
    f.write_bytes(bytes(data))
    d = cases["missing_tensor"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = index["weight_map"].pop("model.norm.weight")
    sd = load_file(str(d / victim))
    sd.pop("model.norm.weight")
    save_file(sd, str(d / victim), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((cases["wrong_shape_in_config"] / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (cases["wrong_shape_in_config"] / "config.json").write_text(json.dumps(cfg))
    other = root / "owners_mismatched_copy_other"  # rank 2's copy: same names, other header
    shutil.copytree(cases["owners_mismatched_copy"], other)
    f = _shards(other)[0]
    save_file(load_file(str(f)), str(f), metadata={"format": "pt", "copy": "other"})
    d = cases["index_path_escape"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../base/" + index["weight_map"][first]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return cases


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("faults")
    cases = _make_cases(root)
    before = {f: _sha(d) for f, d in cases.items()}
    init = tempfile.mktemp(prefix="streamload_faults_pg_")
    outs = [root / f"rank{r}.jsonl" for r in range(WORLD)]
    spec = json.dumps([[f, str(d)] for f, d in cases.items()])
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "fault_worker.py"),
                "--rank",
                str(r),
                "--world",
                str(WORLD),
                "--init",
                init,
                "--cases",
                spec,
                "--out",
                str(outs[r]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in range(WORLD)
    ]
    try:
        logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("fault run hung: a rank did not finish within 300 s")
    finally:
        if os.path.exists(init):
            os.unlink(init)
    rows: dict[str, dict[int, dict]] = {}
    for out in outs:
        for line in out.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["fault"], {})[row["rank"]] = row
    after = {f: _sha(d) for f, d in cases.items()}
    return {"rows": rows, "procs": procs, "logs": logs, "before": before, "after": after}


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_every_rank_raises_named_error(fault_run, fault: str) -> None:
    rows = fault_run["rows"].get(fault)
    assert rows and sorted(rows) == list(range(WORLD)), (fault, fault_run["logs"])
    own, others, failing = EXPECTED[fault]
    for rank, row in rows.items():
        want = own if failing is None or rank == failing else others
        assert row["raised"] == want, (fault, rank, row)
        assert row["seconds"] < 30, (fault, rank, row["seconds"])
        if failing is not None and row["raised"] not in ("RuntimeError", "KeyboardInterrupt"):
            # Named errors carry the failing rank (its own re-raised exception need not).
            assert row["error_rank"] == failing, (fault, rank, row)
    if fault in (
        "truncated_shard",
        "corrupt_header",
        "header_len_beyond_file",
        "index_path_escape",
        "missing_shard",
    ):
        assert all(row["file"] and fault in row["file"] for row in rows.values()), rows
    if fault == "missing_tensor":
        assert "model.norm.weight" in rows[1]["message"]
        assert all("hint: pass strict=False" in row["message"] for row in rows.values()), rows
    if fault == "missing_shard":  # the reader's error, hint included, pickled to the others
        assert all("hint: the download is incomplete" in row["message"] for row in rows.values()), rows
        assert all(row["message"] == rows[0]["message"] for row in rows.values()), rows
    if fault == "owners_mismatched_copy":
        assert all("ranks [2] do not see the same files" in row["message"] for row in rows.values()), rows
        assert all(row["file"].endswith(".safetensors") for row in rows.values()), rows
    if fault == "wrong_shape_in_config":
        assert all(row["tensor"] and "mlp" in row["tensor"] for row in rows.values()), rows
        assert all("own config.json" in row["message"] for row in rows.values()), rows


def test_no_process_left_and_checkpoints_unchanged(fault_run) -> None:
    assert all(p.returncode == 0 for p in fault_run["procs"]), fault_run["logs"]
    assert all(p.poll() is not None for p in fault_run["procs"])
    for fault, sums in fault_run["before"].items():
        if fault == "truncated_while_loading":
            continue  # the test itself truncates this copy mid-load
        assert fault_run["after"][fault] == sums, fault
