"""MoE checkpoints stored one tensor per expert, fused into transformers'
layout straight into each rank's shard: bit-exact against transformers."""

from __future__ import annotations

import cases_load as cases
import pytest
import torch
from rank_group import RankGroup

from streamload.tools.synthetic import make_checkpoint

MODELS = {
    # model type -> config overrides; expert counts do not divide 2, 3 or 4
    "qwen3_moe": dict(num_experts=5, tie=True),
    "qwen2_moe": dict(num_experts=5, tie=False),  # shared expert, attention biases
    "mixtral": dict(num_local_experts=3, tie=True),  # block_sparse_moe / w1 w2 w3 renames
    "olmoe": dict(num_experts=6, tie=False),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {
        mt: str(make_checkpoint(root / mt, mt, seed=11 + i, max_shard_size="24KB", **kw))
        for i, (mt, kw) in enumerate(MODELS.items())
    }


@pytest.fixture(scope="module")
def group():
    g = RankGroup(4)
    yield g
    g.close()


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_moe_matches_transformers(group: RankGroup, ckpts, ws: int) -> None:
    for mt in MODELS:
        res = group.run(cases.case_from_pretrained, ckpt=ckpts[mt], ws=ws, bucket_bytes=3000)
        rep = res[0]["report"]
        fused = [k for k, v in rep["converted"].items() if "MergeModulelist" in v]
        assert fused, f"{mt}: no fused experts reported"
        assert res[0]["tied"] == MODELS[mt]["tie"]


def test_moe_fp32_masters(group: RankGroup, ckpts) -> None:
    group.run(
        cases.case_from_pretrained, ckpt=ckpts["qwen3_moe"], ws=3, dtype=torch.float32, bucket_bytes=3000
    )


def test_moe_zero_expert_rank_and_hsdp(group: RankGroup, ckpts) -> None:
    # mixtral has 3 experts: at 4 ranks rank 3 holds none of gate_up_proj.
    group.run(cases.case_from_pretrained, ckpt=ckpts["mixtral"], ws=4, bucket_bytes=3000)
    group.run(cases.case_from_pretrained, ckpt=ckpts["qwen2_moe"], ws=4, hsdp=True, bucket_bytes=3000)


@pytest.mark.parametrize("ws", [1, 3])
def test_unstreamable_op_falls_back(group: RankGroup, ckpts, ws: int) -> None:
    res = group.run(cases.case_fallback_op, ckpt=ckpts["qwen3_moe"], ws=ws, model_type="qwen3_moe")
    assert res[0]["warned"]


@pytest.fixture(scope="module")
def ingested(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from streamload.tools.cli import main

    root = tmp_path_factory.mktemp("ingested")
    out = {}
    for mt in MODELS:
        dst = root / mt
        assert main(["ingest", ckpts[mt], str(dst), "--max-shard-size", "20KB"]) == 0
        out[mt] = str(dst)
    return out


def test_ingest_output_loads_identically(group: RankGroup, ckpts, ingested) -> None:
    from safetensors import safe_open

    for mt in MODELS:
        keys = [
            k
            for f in sorted(__import__("pathlib").Path(ingested[mt]).glob("*.safetensors"))
            for k in safe_open(str(f), "pt").keys()
        ]
        assert any(k.endswith("experts.gate_up_proj") for k in keys) and not any(
            ".experts.0." in k for k in keys
        )
        # transformers' own load of DST equals its load of SRC ...
        group.run(cases.case_compare_checkpoints, a=ckpts[mt], b=ingested[mt])
        # ... and streamload loads DST with no conversion, bit-exact, at odd and even world sizes.
        for ws in (2, 3):
            res = group.run(
                cases.case_from_pretrained, ckpt=ingested[mt], ws=ws, bucket_bytes=3000, ref_ckpt=ckpts[mt]
            )
            assert res[0]["report"]["converted"] == {}


def test_ingest_is_atomic(ckpts, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import streamload.tools.ingest as ing

    calls = {"n": 0}
    real = ing._fill

    def failing_fill(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("interrupted mid-ingest")
        return real(*args, **kwargs)

    monkeypatch.setattr(ing, "_fill", failing_fill)
    dst = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        ing.ingest(ckpts["qwen3_moe"], dst, max_shard_size="20KB")
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # the partial directory is gone too
    monkeypatch.setattr(ing, "_fill", real)
    ing.ingest(ckpts["qwen3_moe"], dst, max_shard_size="20KB", dtype=torch.float32)
    with pytest.raises(Exception, match="destination exists"):
        ing.ingest(ckpts["qwen3_moe"], dst)


@pytest.mark.parametrize("ws", [3, 4])
def test_moe_owners_mode(group: RankGroup, ckpts, ws: int) -> None:
    for mt in MODELS:
        res = group.run(
            cases.case_from_pretrained,
            ckpt=ckpts[mt],
            ws=ws,
            bucket_bytes=3000,
            readers="owners",
            all_see=True,
        )
        assert all(r["report"]["reader"].startswith("owners") for r in res[:ws])
    res = group.run(cases.case_from_pretrained, ckpt=ckpts["qwen2_moe"], ws=4, bucket_bytes=3000, nodes=2)
    assert res[0]["report"]["reader"].startswith("node")
