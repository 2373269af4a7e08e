"""Architectures beyond the Llama family: MLA low-rank attention with a
persistent router bias and shared experts (deepseek_v3), extra norms and a
non-persistent embed scale (gemma2), Conv1D blocks under transformer.h
(gpt2), fused qkv (phi3) — bit-exact at odd and even world sizes, in the
reader modes."""

from __future__ import annotations

import cases_load as cases
import pytest
from rank_group import RankGroup

from streamload.tools.synthetic import make_checkpoint, make_config

ARCHS = {
    "deepseek_v3": dict(
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=5,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    "gemma2": dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8
    ),
    "gpt2": dict(),
    "phi3": dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    ),
}
TIED = {"gemma2", "gpt2"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    out = {}
    for i, (mt, kw) in enumerate(ARCHS.items()):
        cfg = make_config(mt, layers=3, tie=mt in TIED, **kw)
        out[mt] = str(make_checkpoint(root / mt, mt, config=cfg, seed=50 + i, max_shard_size="40KB"))
    return out


@pytest.fixture(scope="module")
def group():
    g = RankGroup(3)
    yield g
    g.close()


@pytest.mark.parametrize("ws", [2, 3])
def test_architectures_match_transformers(group: RankGroup, ckpts, ws: int) -> None:
    for mt in ARCHS:
        res = group.run(cases.case_from_pretrained, ckpt=ckpts[mt], ws=ws, bucket_bytes=5000)
        assert res[0]["tied"] == (mt in TIED), mt
        res = group.run(
            cases.case_from_pretrained,
            ckpt=ckpts[mt],
            ws=ws,
            bucket_bytes=5000,
            readers="owners",
            all_see=True,
        )
        assert res[0]["report"]["reader"].startswith("owners")


def test_tied_gemma2_trains_like_transformers(group: RankGroup, tmp_path_factory) -> None:
    """Three SGD steps at an uneven world size track transformers' model
    (gemma2's meta model comes out of from_config untied; from_pretrained ties
    it before sharding). float32 files, so the losses compare tightly and the
    reading ranks map their shards; the files stay byte-identical."""
    import torch

    cfg = make_config("gemma2", layers=2, tie=True, **ARCHS["gemma2"])
    ckpt = make_checkpoint(
        tmp_path_factory.mktemp("gemma2_f32"), "gemma2", config=cfg, seed=7, dtype=torch.float32
    )
    for readers in ("owners", "src"):
        res = group.run(cases.case_train_steps, ckpt=str(ckpt), ws=3, readers=readers, map_files=True)
        assert res[0]["bytes_mapped"] > 0
