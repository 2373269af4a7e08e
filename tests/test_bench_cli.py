"""`streamload bench` end to end on a tiny checkpoint with 2 ranks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from streamload.tools.cli import main
from streamload.tools.synthetic import make_checkpoint


def test_bench_writes_json_table_and_plot(tmp_path: Path) -> None:
    ckpt = make_checkpoint(
        tmp_path / "tiny",
        "qwen2",
        tie=True,
        seed=41,
        layers=2,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                str(ckpt),
                "--ranks",
                "2",
                "--strategies",
                "streamload",
                "rank0_broadcast",
                "dcp_hf",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # The floors of a warm load are measured beside any streamload strategy.
    assert [r["strategy"] for r in rows] == [
        "streamload",
        "rank0_broadcast",
        "dcp_hf",
        "floor",
        "floor_thp",
        "floor_populate",
    ]
    for r in rows:
        assert r["world"] == 2 and r["label"] == "tiny"
        assert set(r) >= {
            "seconds",
            "peak_rss",
            "peak_anon_over_baseline",
            "overhead_bytes",
            "bytes_moved",
            "gbps",
            "correct",
            "tie_held",
            "ok",
            "error",
            "file_backed_shard_bytes",
            "touch_seconds",
            "first_step_seconds",
        }
        if r["ok"]:
            assert r["seconds"] > 0 and len(r["peak_rss"]) == 2 and all(x > 0 for x in r["peak_rss"])
            assert r["first_step_seconds"] >= r["seconds"] + r["touch_seconds"] * 0.5
        else:
            assert r["error"]  # a failing strategy is reported, never hidden
    stream = rows[0]
    assert stream["ok"] and stream["correct"] is True and stream["tie_held"] is True
    assert stream["bytes_moved"] > 0 and stream["gbps"] > 0
    table = (out / "table.md").read_text()
    assert "| tiny | 2 | streamload |" in table
    floor = rows[3]
    assert floor["ok"] and floor["correct"] is None  # nothing to verify: it loads no model
    assert floor["shard_bytes"] == stream["shard_bytes"]  # the same bytes, copied once
    # Ratios to the floors, and every phase streamload and the floors report (rank 0's medians).
    assert (
        "first step vs floor / floor_thp / floor_populate" in table
        and "| phase (rank 0, median s) |" in table
    )
    assert "| &nbsp;&nbsp;stream.pack |" in table and "| copy |" in table and "| sum of phases |" in table
    assert set(stream["phases"]) >= {"open", "materialize", "stream", "finalize"}
    assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_file_backed_shards_are_told_apart(tmp_path) -> None:
    """The overhead subtracts only anonymous shards: a view of a mapped file is not one."""
    import mmap

    import torch

    from streamload.tools.bench.runner import _file_backed_bytes

    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mapped = torch.frombuffer(view, dtype=torch.uint8)[4096:]
    private = torch.arange(4096, dtype=torch.uint8)
    assert _file_backed_bytes([mapped, private]) == mapped.numel()


def test_failed_cell_names_the_error() -> None:
    from streamload.tools.bench.table import _first_line

    trace = "CheckpointException ranks:dict_keys([0])\nTraceback (most recent call last):\n  File x\nRuntimeError: Missing key in checkpoint state_dict: a|b.\n"
    assert _first_line(trace) == "RuntimeError: Missing key in checkpoint state_dict: a/b."


def test_first_write_is_undone_exactly() -> None:
    """The first-step pass writes every byte and the correctness pass still sees the load."""
    import torch

    from streamload.tools.bench.runner import _first_write

    shards = [torch.randn(7, 5).to(torch.bfloat16), torch.tensor([255, 0, 7], dtype=torch.uint8)]
    before = [t.clone() for t in shards]
    _first_write(shards)
    assert all(
        not torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(shards, before, strict=True)
    )
    _first_write(shards, -1)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(shards, before, strict=True)
    )


def test_repeats_give_medians_and_spread() -> None:
    from streamload.tools.bench.table import markdown_table, median_of

    runs = [
        {"ok": True, "world": 2, "strategy": "s", "label": "x", "seconds": t, "first_step_seconds": t + 1,
         "touch_seconds": 0.0, "overhead_bytes": 0, "peak_anon_over_baseline": 0, "correct": True,
         "tie_held": None, "file_backed_shard_bytes": 0}
        for t in (3.0, 1.0, 2.0)
    ]  # fmt: skip
    row = median_of(runs)
    assert row["seconds"] == 2.0 and row["seconds_spread"] == (1.0, 3.0) and row["runs"] == 3
    assert row["first_step_seconds"] == 3.0 and row["correct"] is True
    assert "| x | 2 | s | 2.00 (1.00-3.00) | 0.00 | 3.00 (2.00-4.00) |" in markdown_table([row], ["label"])
    # Only the first repeat is verified: its verdict is the row's, whichever run is the median.
    unverified = [dict(r, correct=None) for r in runs[1:]]
    assert median_of([dict(runs[0], correct=False), *unverified])["correct"] is False
    assert median_of([runs[0], *unverified])["correct"] is True


def test_options_parse_as_load_checkpoint_keywords() -> None:
    """``--options KEY=VALUE``: keys are load_checkpoint's keywords, values Python literals (a
    bare word is a string); a bad key, a malformed item or a value of the wrong type is an
    argparse error that names the keywords or the type."""
    import pytest

    from streamload.tools.bench.cli import load_option
    from streamload.tools.bench.strategies import load_keywords
    from streamload.tools.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "--options",
            "direct_io=True",
            "read_mode=cold",
            "bucket_bytes=1048576",
            "--options",
            "node=None",
        ]
    )
    assert args.options == [
        ("direct_io", True),
        ("read_mode", "cold"),
        ("bucket_bytes", 1048576),
        ("node", None),
    ]
    assert load_option("map_files='auto'") == ("map_files", "auto")
    assert load_option("mapping={'a.{i}': 'b.{i}'}") == ("mapping", {"a.{i}": "b.{i}"})
    # What the bench sets itself is not the caller's to pass.
    assert {"direct_io", "prefault", "node", "read_mode"} <= set(load_keywords())
    assert not {"readers", "device_mesh", "progress", "src_rank"} & set(load_keywords())
    for bad, why in [
        ("dirct_io=True", "not a keyword of streamload.load_checkpoint.*direct_io"),
        ("readers='owners'", "not a keyword"),
        ("direct_io", "expected KEY=VALUE"),
        ("direct_io=ture", "expected None | bool"),
        ("bucket_bytes=1<<20", "not a Python literal"),
        ("slots=2.5", "expected int"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            load_option(bad)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", "--options", "dirct_io=True"])
    assert exit_.value.code == 2


@pytest.mark.slow  # about 17 s: --runslow (CI time); the parsing test above runs by default
def test_options_reach_the_streamload_strategy(tmp_path: Path) -> None:
    """A spawned run: ``--options read_mode=cold`` reaches from_pretrained as a keyword (rank 0's
    report shows cold reads, which the default warm mmap load never makes) and is recorded."""
    ckpt = make_checkpoint(
        tmp_path / "tiny",
        "qwen2",
        tie=True,
        seed=43,
        layers=1,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    out = tmp_path / "out"
    argv = [
        "bench",
        str(ckpt),
        "--ranks",
        "2",
        "--strategies",
        "streamload",
        "--no-verify",
        "--out",
        str(out),
    ]
    assert main([*argv, "--options", "read_mode=cold", "prefault=False"]) == 0
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in runs] == ["streamload", "floor", "floor_thp", "floor_populate"]
    row = runs[0]
    assert row["ok"], row["error"]
    assert row["options"] == {"read_mode": "cold", "prefault": False}
    assert any(k.startswith("stream.cold") for k in row["phases"]), row["phases"]
