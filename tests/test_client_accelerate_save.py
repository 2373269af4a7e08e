"""accelerate's ``Accelerator.save_model`` under FSDP2 as a client of ``save_pretrained``:
accelerate's own flow on 2 (and, with --runslow, 3) gloo ranks, the model written by
accelerate's own ``save_model`` and by ``streamload.integrations.accelerate_fsdp.save_model``:
the same safetensors files byte for byte (headers and data), tensor by tensor (names, dtypes,
shapes, bytes), the same index weight map, no config on either side. The index's total_size
differs: accelerate counts FSDP2's padding of uneven shards (see docs/clients/accelerate.md)."""

from __future__ import annotations

import json
from pathlib import Path

import cases_accelerate_save as cases
import pytest
from cases_titan_save import compare_dirs, files, read_dir
from rank_group import RankGroup
from small_shapes import SMALL_DENSE

from streamload.tools.synthetic import make_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("accelerate_save")
    return {
        "tied": str(make_checkpoint(root / "tied", "qwen2", tie=True, seed=51, **SMALL_DENSE)),
        "moe": str(make_checkpoint(root / "moe", "qwen3_moe", seed=52, layers=2, max_shard_size="16KB")),
    }


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def group(request: pytest.FixtureRequest):
    g = RankGroup(request.param)
    yield g
    g.close()


def _check(group: RankGroup, ckpt: str, out: Path, dtype: str, max_shard_size: str) -> dict[str, bytes]:
    """Both saves; the tensors equal always, the files byte for byte where accelerate split the
    model as the data's sizes split it (its split counts FSDP2's padding: see the split test)."""
    res = group.run(
        cases.case_accelerate_save,
        timeout=300,
        ckpt=ckpt,
        out=str(out),
        dtype=dtype,
        max_shard_size=max_shard_size,
    )
    own, mine = Path(res[0]["own"]), Path(res[0]["streamload"])
    assert compare_dirs(own, mine) == []
    assert files(mine) == res[0]["files"]
    assert not any(f.endswith("config.json") for f in files(own) + files(mine))  # weights only
    got = {n: v[2] for n, v in read_dir(mine).items()}
    index = mine / "model.safetensors.index.json"
    if index.exists():
        # streamload's total_size is the data's bytes; accelerate's counts the storage of its
        # gathered tensors, which holds FSDP2's padding of uneven shards (vocab 97 over 2 or 3 ranks).
        ours = json.loads(index.read_text())
        assert ours["metadata"] == {"total_size": sum(len(b) for b in got.values())}
        theirs = json.loads((own / index.name).read_text())
        assert set(theirs["metadata"]) == {"total_size"}
        assert theirs["metadata"]["total_size"] >= ours["metadata"]["total_size"]
        if theirs["weight_map"] != ours["weight_map"]:
            return got
    assert files(own) == files(mine)
    for name in files(own):  # every safetensors file byte for byte: headers and data
        if name.endswith(".safetensors"):
            assert (own / name).read_bytes() == (mine / name).read_bytes(), name
    return got


def test_accelerate_save_tied(group: RankGroup, ckpts: dict[str, str], tmp_path: Path) -> None:
    """qwen2 tied (bf16), one file, byte for byte. accelerate's FSDP2 gather copies the two tied
    names apart, so it writes lm_head.weight too (a second copy of the embedding): so does streamload."""
    got = _check(group, ckpts["tied"], tmp_path, "bfloat16", "10GB")
    assert got["lm_head.weight"] == got["model.embed_tokens.weight"]
    assert files(tmp_path / "streamload") == ["model.safetensors"]


@pytest.mark.slow
def test_accelerate_save_tied_split(group: RankGroup, ckpts: dict[str, str], tmp_path: Path) -> None:
    """Split into files of 16 KB: on 2 ranks accelerate's split is the data's (files byte for
    byte); on 3 its padded embedding sizes move tensors to other files (the tensors still equal)."""
    _check(group, ckpts["tied"], tmp_path, "bfloat16", "16KB")
    theirs = json.loads((tmp_path / "accelerate" / "model.safetensors.index.json").read_text())
    ours = json.loads((tmp_path / "streamload" / "model.safetensors.index.json").read_text())
    assert (theirs["weight_map"] == ours["weight_map"]) is (group.world == 2), (group.world, theirs, ours)


@pytest.mark.slow
def test_accelerate_save_moe(group: RankGroup, ckpts: dict[str, str], tmp_path: Path) -> None:
    """qwen3_moe from a per-expert checkpoint (fp32): accelerate writes the model's fused experts."""
    got = _check(group, ckpts["moe"], tmp_path, "float32", "10GB")
    assert "model.layers.1.mlp.experts.gate_up_proj" in got
    assert not any(".experts.0." in n for n in got)
    assert files(tmp_path / "streamload") == ["model.safetensors"]
