"""Quantized checkpoints at 1-4 gloo ranks, bit-exact against transformers'
own dequantizing from_pretrained on the same files: FP8 block-scaled dense
(Llama), FP8 per-expert MoE fused on the fly (DeepSeek-V3) and MXFP4 fused
experts (GPT-OSS), in both reader modes and on shards whose boundaries fall
inside 128-row blocks; plus fp8 tensors into fp8 / bf16 / fp32 parameters."""

from __future__ import annotations

import json
from pathlib import Path

import cases_quant as cases
import pytest
import torch
from rank_group import RankGroup
from safetensors.torch import load_file, save_file

from streamload.tools.quantized import make_fp8_checkpoint, make_mxfp4_checkpoint
from streamload.tools.synthetic import make_checkpoint

ATTN = dict(num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quant")
    out = {
        # 384 rows shard as 128/128/128 at 3 ranks but 96/96/96/96 at 4 and 192/192 at 2:
        # most boundaries fall inside a 128-row block.
        "fp8_dense": make_fp8_checkpoint(
            root / "fp8_dense", "llama", hidden_size=256, intermediate_size=384, seed=3, max_shard_size="400KB",
            **ATTN,
        ),
        "fp8_moe": make_fp8_checkpoint(
            root / "fp8_moe", "deepseek_v3", hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
            n_routed_experts=5, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            num_attention_heads=4, q_lora_rank=128, kv_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=64,
            v_head_dim=128, n_group=1, topk_group=1, seed=4, max_shard_size="300KB",
        ),
        # down_proj [256, 192] on a ceil grid of 128-blocks (2 x 2), the config silent on
        # the block: transformers derives 96 columns from the grid, and so must streamload.
        "fp8_ragged": make_fp8_checkpoint(
            root / "fp8_ragged", "llama", hidden_size=256, intermediate_size=192, seed=7, ragged=("down_proj.weight",),
            config_block=False, max_shard_size="300KB", **ATTN,
        ),
        "mxfp4": make_mxfp4_checkpoint(
            root / "mxfp4", "gpt_oss", hidden_size=64, intermediate_size=96, num_local_experts=3,
            num_experts_per_tok=2, head_dim=16, layer_types=["sliding_attention", "full_attention"], seed=5,
            max_shard_size="100KB", **ATTN,
        ),
    }  # fmt: skip
    # Plain fp8 tensors, no scales and no quantization_config: the dtype bullet of #15.
    plain = make_checkpoint(root / "fp8_plain", "llama", hidden_size=64, intermediate_size=96, seed=6, **ATTN)
    f = plain / "model.safetensors"
    sd = load_file(str(f))
    sd = {k: (v.to(torch.float8_e4m3fn) if k.endswith("_proj.weight") else v) for k, v in sd.items()}
    save_file(sd, str(f), metadata={"format": "pt"})
    out["fp8_plain"] = plain
    return {k: str(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def group():
    g = RankGroup(4)
    yield g
    g.close()


def test_checkpoints_are_quantized(ckpts: dict[str, str]) -> None:
    for name in ("fp8_dense", "fp8_moe", "mxfp4"):
        cfg = json.loads((Path(ckpts[name]) / "config.json").read_text())
        assert cfg["quantization_config"]["quant_method"] in ("fp8", "mxfp4")
    index = json.loads((Path(ckpts["fp8_moe"]) / "model.safetensors.index.json").read_text())
    assert any(k.endswith("experts.4.up_proj.weight_scale_inv") for k in index["weight_map"])


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
@pytest.mark.parametrize("readers", ["src", "owners"])
def test_quantized_matches_transformers(
    group: RankGroup, ckpts: dict[str, str], ws: int, readers: str
) -> None:
    for name in ("fp8_dense", "fp8_moe", "mxfp4"):
        res = group.run(cases.case_quantized, ckpt=ckpts[name], ws=ws, dtype=torch.bfloat16, readers=readers)
        if name == "fp8_moe":
            assert any("MergeModulelist" in v for v in res[0]["converted"].values())


def test_quantized_node_readers(group: RankGroup, ckpts: dict[str, str]) -> None:
    """Two simulated nodes of two ranks; the first rank of each sees the files."""
    for name in ("fp8_dense", "fp8_moe", "mxfp4"):
        res = group.run(
            cases.case_quantized, ckpt=ckpts[name], ws=4, dtype=torch.bfloat16, readers="node", nodes=2
        )
        assert "node" in str(res[0]["reader"]), res[0]["reader"]


@pytest.mark.parametrize("ws", [1, 3])
def test_keep_quantized_from_pretrained(group: RankGroup, ckpts: dict[str, str], ws: int) -> None:
    for readers in ("src", "owners"):
        res = group.run(cases.case_keep_quantized, ckpt=ckpts["fp8_dense"], ws=ws, readers=readers)
        assert res[0]["fp8"] == 7 * 2  # every projection of both layers


def test_quantized_into_fp32_masters(group: RankGroup, ckpts: dict[str, str]) -> None:
    for name in ("fp8_dense", "fp8_moe", "mxfp4"):
        group.run(cases.case_quantized, ckpt=ckpts[name], ws=3, dtype=torch.float32, readers="src")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_tensors_cast_like_torch(group: RankGroup, ckpts: dict[str, str], dtype: torch.dtype) -> None:
    for readers in ("src", "owners"):
        group.run(cases.case_quantized, ckpt=ckpts["fp8_plain"], ws=3, dtype=dtype, readers=readers)


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_fp8_tensors_into_fp8_params(group: RankGroup, ckpts: dict[str, str], readers: str) -> None:
    res = group.run(cases.case_fp8_params, ckpt=ckpts["fp8_plain"], ws=3, readers=readers)
    assert res[0]["fp8"] > 0


def test_checkpoint_opened_before_fork_reads_in_the_child(group: RankGroup, ckpts: dict[str, str]) -> None:
    group.run(cases.case_fork_child_reads, ckpt=ckpts["fp8_dense"])


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_quantized_fallback_dequantizes_its_inputs(
    group: RankGroup, ckpts: dict[str, str], readers: str
) -> None:
    """A converter op with no streaming form (forced here) runs transformers'
    op on dequantized inputs: fp8 scales are applied, the experts bit-exact."""
    res = group.run(cases.case_quantized_fallback, ckpt=ckpts["fp8_moe"], ws=3, readers=readers)
    assert res[0]["fallbacks"] >= 2  # gate_up_proj and down_proj of the MoE layer


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_fp8_ceil_grid_without_configured_block_matches_transformers(
    group: RankGroup, ckpts: dict[str, str], readers: str
) -> None:
    index = json.loads((Path(ckpts["fp8_ragged"]) / "model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" in index["weight_map"]
    cfg = json.loads((Path(ckpts["fp8_ragged"]) / "config.json").read_text())
    assert "weight_block_size" not in cfg["quantization_config"]
    for ws in (2, 3):
        group.run(
            cases.case_quantized, ckpt=ckpts["fp8_ragged"], ws=ws, dtype=torch.bfloat16, readers=readers
        )
