"""`streamload bench --save` end to end on a tiny checkpoint with 2 ranks, and its measuring parts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from streamload.tools.bench.save import (
    SaveGroup,
    fsync_tree,
    io_write_bytes,
    median_save,
    save_table,
    tree_bytes,
    write_bandwidth,
)
from streamload.tools.bench.save_strategies import SAVE_STRATEGIES, save_rank0
from streamload.tools.cli import main
from streamload.tools.synthetic import make_checkpoint


@pytest.mark.timeout(300)
def test_bench_save_every_strategy(tmp_path: Path) -> None:
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
    out, saved = tmp_path / "out", tmp_path / "saved"
    # Shards of 10 KB: several files and an index, the layout a real checkpoint has.
    argv = ["bench", "--save", str(ckpt), "--ranks", "2", "--repeat", "1", "--max-shard-size", "10KB"]
    argv += ["--out", str(out)]
    assert main([*argv, "--save-dir", str(saved)]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in rows] == SAVE_STRATEGIES
    size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    for r in rows:
        assert r["ok"], (r["strategy"], r["error"])
        assert r["world"] == 2 and r["label"] == "tiny" and r["runs"] == 1
        # Every output loaded by transformers and equal to the model, tensor for tensor.
        assert r["loadable"] is True and r["mismatched"] == [] and r["correct"] is True, r
        assert r["seconds"] > 0 and len(r["peak_anon_per_rank"]) == 2
        assert r["peak_anon_max"] == max(r["peak_anon_per_rank"])
        # The disk probe wrote the checkpoint's size in the same run.
        assert r["checkpoint_bytes"] == size and r["disk_write_seconds"] > 0 and r["disk_write_gbps"] > 0
        assert len(r["write_bytes"]) == 2 and r["disk_bytes_written"] == sum(r["write_bytes"])
        # /tmp is a real disk here: page-cache writes are counted, at least the tensors once.
        assert r["disk_bytes_written"] >= size * 0.9, r
        assert r["output_bytes"] >= size
    by = {r["strategy"]: r for r in rows}
    files = by["rank0"]["output_files"]  # transformers' own split
    assert files >= 2
    for s in ("streamload_owners", "streamload_src"):
        assert by[s]["hub_names"] is True and by[s]["output_files"] == files
    # DCP keeps its per-rank shards beside the consolidated files: twice the bytes.
    dcp = by["dcp_consolidate"]
    assert dcp["output_files"] >= files + 2 and dcp["output_bytes"] >= 2 * size and dcp["hub_names"] is True
    # The rank-0 export passes a gathered state dict: the tied head is written a second time.
    assert by["rank0"]["hub_names"] is False and by["rank0"]["extra_keys"] == ["lm_head.weight"]
    table = (out / "table.md").read_text()
    for s in SAVE_STRATEGIES:
        assert f"| tiny | 2 | {s} |" in table
    assert "disk write s (GB/s)" in table and "| True |" in table and "failed" not in table
    assert not list(saved.iterdir())  # every output removed after its run


def corrupt_save(model, out: str, opts: dict) -> None:
    """The rank-0 export with one element of ``model.norm.weight`` changed afterwards."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    save_rank0(model, out, opts)
    if dist.get_rank() == 0:
        path = os.path.join(out, "model.safetensors")
        tensors = load_file(path)
        tensors["model.norm.weight"][0] += torch.tensor(1.0, dtype=tensors["model.norm.weight"].dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    dist.barrier()


def float32_save(model, out: str, opts: dict) -> None:
    """The rank-0 export with every tensor stored as float32 (from_pretrained casts it back)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(out, state_dict={k: v.float() for k, v in sd.items()})
    dist.barrier()


def failing_save(model, out: str, opts: dict) -> None:
    raise OSError(28, "No space left on device")


@pytest.mark.timeout(300)
def test_the_check_catches_a_wrong_tensor_and_a_failure_is_a_row(tmp_path: Path) -> None:
    """A saver whose output differs in one tensor is reported incorrect, naming it; a saver that
    raises on every rank is a failed run, and the same ranks then save correctly."""
    ckpt = make_checkpoint(
        tmp_path / "tiny", "qwen2", tie=False, seed=44, layers=1, vocab=32, hidden_size=16,
        intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    group = SaveGroup(2, str(ckpt), "bfloat16")
    try:
        bad = group.run(f"{__name__}:corrupt_save", str(tmp_path / "a"), verify=True, max_shard_size="5GB")
        assert bad.ok and bad.loadable is True and bad.hub_names is True
        assert bad.correct is False and bad.mismatched == ["model.norm.weight"]
        wide = group.run(f"{__name__}:float32_save", str(tmp_path / "w"), verify=True, max_shard_size="5GB")
        assert wide.ok and wide.loadable is True and wide.correct is False
        assert wide.mismatched and all("(stored F32 " in m for m in wide.mismatched)
        failed = group.run(f"{__name__}:failing_save", str(tmp_path / "b"), verify=True, max_shard_size="5GB")
        assert not failed.ok and "No space left on device" in (failed.error or "")
        pids = [p.pid for p in group.group.procs]
        good = group.run("rank0", str(tmp_path / "c"), verify=True, max_shard_size="5GB")
        assert good.ok and good.correct is True and good.hub_names is True  # untied: nothing extra
        assert [p.pid for p in group.group.procs] == pids  # a failure on every rank keeps the ranks
    finally:
        group.close()


def test_load_strategy_names_need_no_save_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="need --save"):
        main(["bench", str(tmp_path), "--strategies", "dcp_consolidate", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="--cold, --options"):
        main(["bench", "--save", str(tmp_path), "--cold", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="unknown strategies"):
        main(["bench", "--save", str(tmp_path), "--strategies", "dcp_hf", "--out", str(tmp_path / "o")])


def test_write_bandwidth_writes_and_removes_its_probe(tmp_path: Path) -> None:
    before = io_write_bytes()
    bw = write_bandwidth(str(tmp_path), (3 << 20) + 5, block=1 << 20)
    assert bw.bytes == (3 << 20) + 5 and bw.seconds > 0 and bw.gbps > 0
    assert io_write_bytes() - before >= 3 << 20  # it reached the page cache of a real file system
    assert list(tmp_path.iterdir()) == []


def test_fsync_tree_and_tree_bytes(tmp_path: Path) -> None:
    (tmp_path / "a" / "sharded").mkdir(parents=True)
    (tmp_path / "a" / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "a" / "sharded" / "s.safetensors").write_bytes(b"y" * 7)
    (tmp_path / "a" / "config.json").write_bytes(b"{}")
    os.symlink(tmp_path / "a" / "config.json", tmp_path / "a" / "link.json")
    fsync_tree(str(tmp_path / "a"))
    assert tree_bytes(str(tmp_path / "a")) == (19, 2)  # the link is not counted twice


def _run(strategy: str, seconds: float, ok: bool = True, correct: bool | None = None) -> dict:
    return {
        "strategy": strategy,
        "world": 2,
        "label": "m",
        "ok": ok,
        "error": None if ok else "RuntimeError: boom",
        "seconds": seconds,
        "peak_anon_max": int(seconds * 1000),
        "peak_anon_per_rank": [int(seconds * 1000), 0],
        "disk_write_seconds": 1.0,
        "disk_write_gbps": 2.0,
        "disk_bytes_written": 5 << 20,
        "output_bytes": 4 << 20,
        "output_files": 1,
        "hub_names": True,
        "correct": correct,
    }


def test_median_and_table() -> None:
    row = median_save([_run("rank0", 3.0, correct=True), _run("rank0", 1.0), _run("rank0", 2.0)])
    assert row["seconds"] == 2.0 and row["seconds_spread"] == (1.0, 3.0) and row["runs"] == 3
    assert row["correct"] is True and row["peak_anon_max"] == 2000
    fast = median_save([_run("streamload_owners", 0.5, correct=False)])
    failed = median_save([_run("dcp_consolidate", 9.0, ok=False)])
    table = save_table([row, fast, failed], ["label"])
    assert "| m | 2 | rank0 | 2.00 (1.00-3.00) | 1.00 (2.00) | 2.00x | 1.00x |" in table
    assert "| m | 2 | streamload_owners | 0.50 (0.50-0.50) | 1.00 (2.00) | 0.50x | 0.25x |" in table
    assert "| False |" in table  # an output that failed the check says so
    assert "| m | 2 | dcp_consolidate | failed: RuntimeError: boom |" in table


@pytest.mark.timeout(300)
def test_moe_names_per_strategy(tmp_path: Path) -> None:
    """On a fused MoE model streamload and transformers write the hub's per-expert tensors; DCP
    writes the model's fused names (still loadable: transformers converts them on load)."""
    ckpt = make_checkpoint(tmp_path / "moe", "qwen3_moe", tie=False, seed=45, num_experts=4, layers=2)
    group = SaveGroup(2, str(ckpt), "bfloat16")
    try:
        runs = {
            s: group.run(s, str(tmp_path / s), verify=True, max_shard_size="5GB")
            for s in ("streamload_owners", "rank0", "dcp_consolidate")
        }
    finally:
        group.close()
    for s, r in runs.items():
        assert r.ok and r.correct is True, (s, r.error, r.mismatched)
    assert runs["streamload_owners"].hub_names is True and runs["rank0"].hub_names is True
    dcp = runs["dcp_consolidate"]
    assert dcp.hub_names is False and "model.layers.0.mlp.experts.gate_up_proj" in dcp.extra_keys
    assert dcp.extra_key_count == 4 and dcp.missing_key_count == 2 * 4 * 3  # 2 layers x 4 experts x 3


def test_client_save_strategies_resolve_to_the_clients_own_code() -> None:
    """Each client's own export (and streamload's entry for it) is a strategy name of
    ``bench --save``; where the framework is installed (CI: the clients extra) each resolves.
    In a process of its own: importing AReaL reconfigures logging (every existing logger
    disabled, streamload's too), which would leak into the tests after this one."""
    import subprocess
    import sys

    code = """
import importlib.util
from streamload.tools.bench.save_strategies import CLIENT_SAVERS, saver_fn
needs = {"verl": "verl", "areal": "areal", "accelerate": "accelerate", "titan": "torchtitan"}
checked = 0
for name, target in CLIENT_SAVERS.items():
    if importlib.util.find_spec(needs[name.split("_")[0]]) is None:
        continue
    fn = saver_fn(name)
    assert callable(fn) and f"{fn.__module__}:{fn.__name__}" == target, name
    checked += 1
print("checked", checked)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:][0] == "checked", proc.stdout
