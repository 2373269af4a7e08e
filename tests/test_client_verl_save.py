"""verl 0.9.1's own HF saves against streamload's, on CPU gloo ranks: ``FSDPCheckpointManager``'s
``hf_model`` content (verl's class, then ``streamload.integrations.verl_save.FSDPCheckpointManager``)
and the model merger (verl's ``FSDPModelMerger`` in one process, then
``streamload.integrations.verl_merge.merge_fsdp_checkpoint`` on the run's ranks), the two output
directories compared tensor by tensor (names, dtypes, shapes, bytes) and file by file."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from rank_group import RankGroup
from small_shapes import SMALL_DENSE

if importlib.util.find_spec("verl") is None:
    pytest.skip(
        "verl is a client extra: pip install --no-deps -r .ci/clients-nodeps.txt", allow_module_level=True
    )

import cases_verl_areal_save as cases  # noqa: E402

from streamload.tools.synthetic import make_checkpoint  # noqa: E402

# verl's config.json names its bf16 save copy's dtype over the fp32 tensors it writes.
CONFIG_DTYPE = ["config.json[dtype]: 'bfloat16' vs 'float32'"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("verl_save")
    return {
        "dense": str(make_checkpoint(root / "dense", "qwen2", tie=True, seed=41, **SMALL_DENSE)),
        # transformers 5 writes qwen3_moe one tensor per expert; the model fuses them.
        "moe": str(
            make_checkpoint(
                root / "moe", "qwen3_moe", tie=True, seed=42, num_experts=5, max_shard_size="30KB"
            )
        ),
    }


@pytest.fixture(scope="module")
def group3() -> Iterator[RankGroup]:
    g = RankGroup(3)
    yield g
    g.close()


def _hf_model(group: RankGroup, ckpt: str, out: str, flip: bool = False) -> None:
    res = group.run(cases.case_verl_hf_model, ckpt=ckpt, out=out, flip=flip)[0]
    assert res["diff"] == [] and res["legit"] == CONFIG_DTYPE and res["steps_equal"], res
    assert "model.safetensors" in res["identical_files"] and res["tensors"] > 0, res
    if flip:  # the comparison catches one flipped byte
        assert any("bytes differ" in d for d in res["flipped"]), res["flipped"]


def _merge(group: RankGroup, ckpt: str, out: str, flip: bool = False) -> None:
    res = group.run(cases.case_verl_merge, ckpt=ckpt, out=out, flip=flip)[0]
    assert res["diff"] == [] and res["legit"] == [], res
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(
        res["identical_files"]
    ), res
    if flip:
        assert any("bytes differ" in d for d in res["flipped"]), res["flipped"]


def test_hf_model_dense_tied_2_ranks(group2: RankGroup, ckpts, tmp_path) -> None:
    _hf_model(group2, ckpts["dense"], str(tmp_path), flip=True)


def test_merge_moe_per_expert_2_ranks(group2: RankGroup, ckpts, tmp_path) -> None:
    _merge(group2, ckpts["moe"], str(tmp_path), flip=True)


@pytest.mark.slow
def test_hf_model_moe_per_expert_2_ranks(group2: RankGroup, ckpts, tmp_path) -> None:
    _hf_model(group2, ckpts["moe"], str(tmp_path))


@pytest.mark.slow
def test_merge_dense_tied_2_ranks(group2: RankGroup, ckpts, tmp_path) -> None:
    _merge(group2, ckpts["dense"], str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_hf_model_3_ranks(group3: RankGroup, ckpts, tmp_path, model: str) -> None:
    _hf_model(group3, ckpts[model], str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_merge_3_ranks(group3: RankGroup, ckpts, tmp_path, model: str) -> None:
    _merge(group3, ckpts[model], str(tmp_path))
