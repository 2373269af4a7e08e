"""AReaL 1.0.4's own HF save (``FSDPEngine._save_model_to_hf``, its code on a stand-in engine)
against ``streamload.integrations.areal_save.save_model_to_hf`` on the same FSDP2 model, on CPU
gloo ranks; the two directories compared tensor by tensor (names, dtypes, shapes, bytes) and file
by file."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import cases_verl_areal_save as cases
import pytest
from rank_group import RankGroup
from small_shapes import SMALL_DENSE

from streamload.tools.synthetic import make_checkpoint

# Only the rank processes import AReaL (it reconfigures logging process-wide).
if importlib.util.find_spec("areal") is None:
    pytest.skip("AReaL: pip install --no-deps -r .ci/clients-nodeps.txt", allow_module_level=True)

# AReaL's checkpoint stores the tied head again (equal bytes); streamload stores the tie once.
TIE_TWICE = ["tensor lm_head.weight: stored again by the framework (the tie to model.embed_tokens.weight)"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("areal_save")
    return {
        "dense": str(make_checkpoint(root / "dense", "qwen2", tie=True, seed=51, **SMALL_DENSE)),
        "moe": str(
            make_checkpoint(
                root / "moe", "qwen3_moe", tie=True, seed=52, num_experts=5, max_shard_size="30KB"
            )
        ),
    }


@pytest.fixture(scope="module")
def group3() -> Iterator[RankGroup]:
    g = RankGroup(3)
    yield g
    g.close()


def _check(group: RankGroup, ckpt: str, out: str, flip: bool = False) -> None:
    res = group.run(cases.case_areal_hf, ckpt=ckpt, out=out, flip=flip)[0]
    assert res["diff"] == [] and res["legit"] == TIE_TWICE, res
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(res["identical_files"]), res
    if flip:  # the comparison catches one flipped byte
        assert any("bytes differ" in d for d in res["flipped"]), res["flipped"]


def test_areal_hf_moe_per_expert_2_ranks(group2: RankGroup, ckpts, tmp_path) -> None:
    _check(group2, ckpts["moe"], str(tmp_path), flip=True)


@pytest.mark.slow
def test_areal_hf_dense_tied_2_ranks(group2: RankGroup, ckpts, tmp_path) -> None:
    _check(group2, ckpts["dense"], str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_areal_hf_3_ranks(group3: RankGroup, ckpts, tmp_path, model: str) -> None:
    _check(group3, ckpts[model], str(tmp_path))
