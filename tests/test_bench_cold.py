"""`streamload bench --cold` end to end on a tiny checkpoint with 2 ranks:
evicted before each strategy (mincore agrees), the disk line, repeats."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from streamload.tools.cli import main
from streamload.tools.synthetic import make_checkpoint


def test_bench_cold_evicts_measures_the_disk_and_repeats(tmp_path: Path) -> None:
    ckpt = make_checkpoint(
        tmp_path / "tiny",
        "qwen2",
        tie=True,
        seed=43,
        layers=2,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    # Each run spawns two ranks: keep the test to two strategies.
    other = (
        "fastsafetensors" if importlib.util.find_spec("fastsafetensors") is not None else "rank0_broadcast"
    )
    strategies = ["streamload_owners", other]
    out = tmp_path / "out"
    argv = ["bench", str(ckpt), "--cold", "--repeat", "2", "--ranks", "2", "--out", str(out), "--strategies"]
    assert main([*argv, *strategies]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in rows] == strategies
    for r in rows:
        assert r["ok"] and r["correct"] and r["tie_held"], r
        assert r["cold"] and r["resident_before"] < 0.01
        assert r["repeats"] == 2 and len(r["cold_seconds_all"]) == 2
        assert r["disk_gbps"] > 0 and r["file_bytes"] > 0 and r["buffered_gbps"] > 0
        assert len(r["cpu_seconds"]) == 2 and all(c > 0 for c in r["cpu_seconds"]), r
    owners = rows[0]
    # The ranks read from the disk (a rank may find a file this small cached by its peer's
    # reads and map it: read_mode "auto" decides per rank), none more than the files.
    assert sum(owners["disk_bytes_read"]) > 0 and owners["shard_bytes"] > 0, owners
    assert max(owners["disk_bytes_read"]) <= owners["file_bytes"], owners
    table = (out / "table.md").read_text()
    assert "vs read once" in table and "read files once s" in table and "one buffered stream s" in table
