"""torchtitan 0.3.0's HF export (``last_save_in_hf``) as a client of ``save_pretrained``: its own
Qwen3 models (dense with tied embeddings; per-expert MoE), parallelised with its own
``parallelize_qwen3`` on 2 (and, with --runslow, 3) gloo ranks, written by torchtitan's own
``CheckpointManager._save_last_step`` and by ``streamload.integrations.torchtitan.save_hf``:
the same tensors, names, dtypes, shapes and bytes (the files around them differ: see
docs/clients/torchtitan.md, "Saving")."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is a clients extra (.ci/clients-nodeps.txt)", allow_module_level=True)
import cases_titan_save as cases  # noqa: E402
import titan_models as tm  # noqa: E402
from rank_group import RankGroup  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("titan_save")
    return {
        kind: tm.write_checkpoint(root / kind, kind, seed=21 + i) for i, kind in enumerate(("dense", "moe"))
    }


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def group(request: pytest.FixtureRequest):
    g = RankGroup(request.param)
    yield g
    g.close()


def _check(
    group: RankGroup, ckpt: str, out: Path, kind: str, export_dtype: str, assets: bool = False
) -> None:
    res = group.run(
        cases.case_titan_save,
        timeout=300,
        kind=kind,
        path=ckpt,
        out=str(out),
        export_dtype=export_dtype,
        assets=assets,
    )
    own, mine = res[0]["own"], res[0]["streamload"]
    assert cases.compare_dirs(own, mine) == []
    got = cases.read_dir(mine)
    assert {d for d, _, _ in got.values()} == {f"torch.{export_dtype}"}
    # torchtitan's own output is what the original hub checkpoint holds (tie dropped, experts split).
    assert set(got) == set(cases.read_dir(ckpt))
    if kind == "dense":
        assert "lm_head.weight" not in got
    else:
        assert "model.layers.1.mlp.experts.11.down_proj.weight" in got
    # The files around the tensors: torchtitan's index always and its DCP shards left in
    # sharded/; streamload's transformers layout (an index only when split).
    theirs = cases.files(own)
    assert "model.safetensors.index.json" in theirs
    assert any(f.startswith("sharded/") for f in theirs), theirs
    assert cases.index_names(own) == sorted(got)
    weights = sorted(f for f in theirs if "/" not in f and f.endswith(".safetensors"))
    if assets:  # the hub checkpoint's own split, file for file
        assert weights == sorted(p.name for p in Path(ckpt).glob("*.safetensors")) and len(weights) > 1
        assert cases.files(mine) == [*weights, "model.safetensors.index.json"]
        assert cases.weight_map(own) == cases.weight_map(mine) == cases.weight_map(ckpt)
    else:  # one file
        assert weights == ["model-00001-of-00001.safetensors"]
        assert cases.files(mine) == ["model.safetensors"]


def test_titan_save_dense_tied(group: RankGroup, ckpts: dict[str, str], tmp_path: Path) -> None:
    _check(group, ckpts["dense"], tmp_path, "dense", "bfloat16")


@pytest.mark.slow
def test_titan_save_dense_tied_assets(group: RankGroup, ckpts: dict[str, str], tmp_path: Path) -> None:
    """With ``hf_assets_path``: torchtitan's and streamload's files are the hub checkpoint's split."""
    _check(group, ckpts["dense"], tmp_path, "dense", "bfloat16", assets=True)


@pytest.mark.slow
def test_titan_save_moe(group: RankGroup, ckpts: dict[str, str], tmp_path: Path) -> None:
    _check(group, ckpts["moe"], tmp_path, "moe", "float32")


@pytest.mark.slow
def test_titan_save_moe_assets(group: RankGroup, ckpts: dict[str, str], tmp_path: Path) -> None:
    _check(group, ckpts["moe"], tmp_path, "moe", "float32", assets=True)


@pytest.mark.slow
def test_titan_save_refused_adapter(group: RankGroup, ckpts: dict[str, str], tmp_path: Path) -> None:
    out = group.run(cases.case_titan_save_refused, timeout=300, path=ckpts["dense"], out=str(tmp_path / "x"))
    assert all(r.startswith("MappingError written=False") and "llama3" in r for r in out), out


def test_compare_dirs_sees_one_byte(ckpts: dict[str, str], tmp_path: Path) -> None:
    """The comparison fails on one flipped byte of one tensor (and passes on a copy)."""
    from safetensors import safe_open

    copy = tmp_path / "copy"
    shutil.copytree(ckpts["dense"], copy)
    assert cases.compare_dirs(ckpts["dense"], copy) == []
    f = sorted(copy.glob("*.safetensors"))[-1]
    with safe_open(str(f), framework="pt") as fh:
        key = next(iter(fh.keys()))
    import json
    import struct

    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    start = 8 + n + json.loads(raw[8 : 8 + n])[key]["data_offsets"][0]
    raw[start + 1] ^= 0x01
    f.write_bytes(bytes(raw))
    assert cases.compare_dirs(ckpts["dense"], copy) == [f"{key}: bytes differ"]
    assert torch.__version__  # torch imported for safetensors' pt framework
