"""TP x FSDP (parallelize_module, then fully_shard over "dp"), expert parallel x
FSDP and pipeline stages on a 2x2 mesh of 4 gloo ranks, bit-exact against
transformers' from_pretrained."""

from __future__ import annotations

import cases_parallel as cases
import pytest
from rank_group import RankGroup

from streamload.tools.synthetic import make_checkpoint

WORLD = 4
STRIDED = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # FSDP over dp on top of a dim-0 shard over tp/ep


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel")
    # vocab 62: 31 rows per tp rank, split 16 / 15 by dp (uneven).
    dense = dict(vocab=62, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    return {
        "llama": str(make_checkpoint(root / "llama", "llama", tie=False, seed=3, layers=2, max_shard_size="16KB", **dense)),
        "llama4": str(make_checkpoint(root / "llama4", "llama", tie=False, seed=6, layers=4, max_shard_size="16KB", **dense)),
        "qwen3_moe": str(make_checkpoint(root / "qwen3_moe", "qwen3_moe", tie=True, seed=4, num_experts=4, layers=2, max_shard_size="24KB")),
        "qwen3_moe8": str(make_checkpoint(root / "qwen3_moe8", "qwen3_moe", tie=False, seed=7, num_experts=8, layers=2, max_shard_size="24KB")),
    }  # fmt: skip


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


@pytest.mark.parametrize("readers", ["src", "owners", "node"])
@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_tp_fsdp(group: RankGroup, ckpts, model: str, readers: str) -> None:
    res = group.run(cases.case_tp_fsdp, timeout=240, ckpt=ckpts[model], readers=readers)
    for r in res:
        assert r["reader"].startswith(readers)
        # colwise (+FSDP) gives the strided layout, rowwise (+FSDP) shards two dims.
        assert STRIDED in r["placements"] and "(Shard(dim=0), Shard(dim=1))" in r["placements"]
        assert r["experts"] == (4 if model == "qwen3_moe" else 0)


def test_ep_fsdp_reads_own_share(group: RankGroup, ckpts) -> None:
    res = group.run(cases.case_ep_fsdp, timeout=240, ckpt=ckpts["qwen3_moe8"])
    for r in res:
        assert r["placements"] == [STRIDED]
        # Each rank reads exactly the bytes of its own shards: 2 of the 8 experts per layer.
        assert r["bytes_read"] == r["share"]
        assert r["expert_local"] * 4 == r["expert_full"]
        assert r["bytes_read"] < r["ckpt_bytes"] / 2
    print("bytes read per rank:", [r["bytes_read"] for r in res], "of", res[0]["ckpt_bytes"])


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_pipeline_stages(group: RankGroup, ckpts, readers: str) -> None:
    res = group.run(cases.case_pipeline_stage, timeout=240, ckpt=ckpts["llama4"], readers=readers)
    assert [r["layers"] for r in res] == [["0", "1"], ["0", "1"], ["2", "3"], ["2", "3"]]
    # Stage 0 skips layers 2-3, the norm and lm_head; stage 1 skips the embedding and layers 0-1.
    assert "lm_head.weight" in res[0]["skipped"] and "model.embed_tokens.weight" in res[2]["skipped"]
    assert not any(k.startswith(("model.layers.0.", "model.layers.1.")) for k in res[0]["skipped"])


def test_pipeline_stage_errors(group: RankGroup, ckpts) -> None:
    # Without the option a stage's foreign tensors are an error, as before.
    res = group.run(cases.case_pipeline_stage, timeout=240, ckpt=ckpts["llama4"], unexpected="error")
    assert all(r["error"] == "KeyMismatchError" and r["unexpected"] and not r["missing"] for r in res)
    # With it, a tensor the stage holds and the files lack still raises.
    res = group.run(cases.case_pipeline_stage, timeout=240, ckpt=ckpts["llama4"], extra_layer=True)
    for r in res:
        assert r["error"] == "KeyMismatchError" and not r["unexpected"]
        assert r["missing"] and all(k.startswith("model.layers.4.") for k in r["missing"])
