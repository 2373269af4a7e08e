"""`streamload bench --remote` end to end on a tiny checkpoint served from a local S3 endpoint
(2 ranks), and the ranged-read plan its ceilings use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamload.tools.bench.remote_strategies import Part, rank_share, whole_objects


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_shares_cover_every_byte_once(world: int) -> None:
    """The ceilings' shares: every byte of every object read by exactly one rank, in ranges of at
    most the chunk, each rank's landing contiguously in its buffer from 0."""
    objects = [("a", 10), ("b", 0), ("c", 23), ("d", 1)]
    seen: dict[str, list[int]] = {k: [0] * n for k, n in objects}
    for rank in range(world):
        parts = rank_share(objects, rank, world, chunk=4)
        assert all(0 < p.end - p.start <= 4 for p in parts)
        at = 0
        for p in parts:
            assert p.dest == at
            at += p.end - p.start
            for i in range(p.start, p.end):
                seen[p.path][i] += 1
    assert all(c == 1 for counts in seen.values() for c in counts)


def test_whole_objects_cut_in_chunks() -> None:
    assert whole_objects([("x", 9), ("y", 0)], chunk=4) == [
        Part("x", 0, 4, 0),
        Part("x", 4, 8, 4),
        Part("x", 8, 9, 8),
    ]


@pytest.mark.slow  # about 30 s: --runslow (CI time); the share arithmetic above runs by default
@pytest.mark.timeout(400)
def test_bench_remote_every_strategy(tmp_path: Path) -> None:
    for module in ("moto", "obstore", "s3fs", "runai_model_streamer", "runai_model_streamer_s3"):
        pytest.importorskip(module)
    from streamload.tools.bench.remote import REMOTE_STRATEGIES
    from streamload.tools.cli import main
    from streamload.tools.synthetic import make_checkpoint

    # About 17 MB in 3 files with an index: the layout of a real checkpoint.
    ckpt = make_checkpoint(
        tmp_path / "tiny",
        "qwen2",
        tie=True,
        seed=45,
        max_shard_size="8MB",
        layers=3,
        vocab=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    assert len(list(ckpt.glob("*.safetensors"))) >= 2
    out = tmp_path / "out"
    assert main(["bench", "--remote", str(ckpt), "--ranks", "2", "--repeat", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in rows] == REMOTE_STRATEGIES
    needed = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    jsons = sum(p.stat().st_size for p in ckpt.glob("*.json"))
    for r in rows:
        assert r["ok"], (r["strategy"], r["error"])
        assert r["world"] == 2 and r["label"] == "tiny" and r["needed_bytes"] == needed
        assert r["seconds"] > 0 and len(r["peak_anon_per_rank"]) == 2
        assert len(r["peak_rss"]) == 2 and all(m > 0 for m in r["peak_rss"])
        assert all(b is not None for b in r["fetched_bytes"]), r
    by = {r["strategy"]: r for r in rows}
    for s in ("ceiling", "ceiling_s3fs"):
        # No model: each rank read its half of the safetensors bytes, together every byte once.
        assert by[s]["correct"] is None and sum(by[s]["fetched_bytes"]) == needed
        assert all(abs(b - needed / 2) <= 1 for b in by[s]["fetched_bytes"])
    for s in ("streamload_src", "streamload_owners", "runai", "download_then_load"):
        assert by[s]["correct"] is True and by[s]["mismatched"] == [], by[s]
        assert by[s]["tie_held"] is True
    fetched = {s: sum(r["fetched_bytes"]) for s, r in by.items()}
    # src: one rank reads the files once (headers are part of them); owners: each rank its own
    # shards and the headers; runai: the files and the configs on rank 0, the configs elsewhere;
    # download: every object on every rank.
    assert needed <= fetched["streamload_src"] <= needed * 1.05
    assert by["streamload_src"]["fetched_bytes"][1] == 0
    assert needed * 0.9 <= fetched["streamload_owners"] <= needed * 1.3
    assert all(0 < b < needed for b in by["streamload_owners"]["fetched_bytes"])
    assert fetched["runai"] == needed + 2 * jsons
    assert fetched["download_then_load"] == 2 * (needed + jsons)
    for s in ("streamload_src", "streamload_owners"):
        assert sum(by[s]["requests"]) > 0 and sum(by[s]["retries"]) == 0
    table = (out / "table.md").read_text()
    for s in REMOTE_STRATEGIES:
        assert f"| tiny | 2 | {s} |" in table
    assert "fetched / needed" in table and "failed" not in table
    assert "| tiny | 2 | ceiling | " in table and "| 1.00x | 1.00 |" in table
