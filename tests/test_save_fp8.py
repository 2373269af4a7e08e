"""save_pretrained(quantize="fp8"): DeepSeek-V3's block-scaled fp8, computed per rank on its
own shards (blocks cut by shard edges agreed), bit-equal to a reference quantizer on the
gathered tensors, loaded back by streamload and by transformers."""

from __future__ import annotations

import pytest
import torch
from cases_save_fp8 import case_fp8_plain_tp, case_fp8_round_trip
from rank_group import RankGroup

import streamload
from streamload.tools.synthetic import make_checkpoint

_SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, layers=1, vocab=128)
MODELS = {
    # q/o/down [128, *] cut by 2 and 3 ranks; k/v [64, 128] not divisible: left in bf16
    "qwen2": dict(_SMALL, intermediate_size=256, tie=True),
    # per-expert gate/up/down [128, 128] from fused experts; the router stays bf16
    "qwen3_moe": dict(_SMALL, intermediate_size=256, moe_intermediate_size=128, head_dim=32, num_experts=4),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8_src")
    return {
        mt: str(make_checkpoint(root / mt, mt, seed=41 + i, **kw))
        for i, (mt, kw) in enumerate(MODELS.items())
    }


@pytest.fixture(scope="module")
def group():
    g = RankGroup(3)
    yield g
    g.close()


@pytest.mark.parametrize(
    ("mt", "ws", "writers"),
    [("qwen2", 2, "src"), ("qwen2", 3, "owners"), ("qwen3_moe", 2, "owners"), ("qwen3_moe", 3, "src")],
)
def test_fp8_round_trip(group: RankGroup, ckpts, tmp_path, mt: str, ws: int, writers: str) -> None:
    res = group.run(
        case_fp8_round_trip, ckpt=ckpts[mt], ws=ws, out=str(tmp_path / "o"), writers=writers, timeout=120
    )
    assert all(r["report"].writers == writers for r in res[:ws])
    qc = res[0]["config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    kept = qc["modules_to_not_convert"]
    assert "lm_head" in kept and "model.layers.0.self_attn.k_proj" in kept, kept
    quantized = res[0]["quantized"]
    assert "model.layers.0.self_attn.q_proj.weight" in quantized
    assert not any(
        "embed" in k or "norm" in k or "lm_head" in k or k.endswith("mlp.gate.weight") for k in quantized
    )
    if mt == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in quantized
    else:  # shard edges inside 128-row blocks: their amax was agreed across ranks
        rows = res[0]["local_rows"]["model.layers.0.self_attn.q_proj.weight"]
        assert rows % 128 != 0, rows


@pytest.mark.parametrize(("ws", "writers"), [(2, "owners"), (3, "src")])
def test_fp8_blocks_cut_by_rows_and_columns(group: RankGroup, tmp_path, ws: int, writers: str) -> None:
    group.run(case_fp8_plain_tp, ws=ws, out=str(tmp_path / "o"), writers=writers)


def test_fp8_scales_are_transformers_arithmetic() -> None:
    from cases_save_fp8 import ref_quantize, transformers_quantize

    from streamload.save.quantize import fp8_scales

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 384, generator=g) * torch.logspace(-6, 3, 256).unsqueeze(1)).to(torch.bfloat16)
    w[:128, :128] = 0
    q, inv = ref_quantize(w)
    theirs = transformers_quantize("a.weight", w)
    assert torch.equal(q.view(torch.uint8), theirs["a.weight"].view(torch.uint8))
    assert torch.equal(inv, theirs["a.weight_scale_inv"])
    amax = w.float().reshape(2, 128, 3, 128).abs().amax(dim=(-3, -1))
    assert torch.equal(fp8_scales(amax)[1], inv) and inv[0, 0] == 1


def test_fp8_choice_keeps_gates_and_undivisible_linears() -> None:
    from transformers import AutoModelForCausalLM

    from streamload.save.layout import output_layout
    from streamload.save.plan import tile_model
    from streamload.save.quantize import choose_fp8
    from streamload.tools.synthetic import make_config

    cfg = make_config(
        "qwen2_moe",
        **dict(_SMALL, intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128),
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layout = output_layout(model)
    choice = choose_fp8(model, layout, tile_model(model, layout)[1])
    assert "model.layers.0.mlp.shared_expert_gate" in choice.kept  # a Linear gate: bf16
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in choice.keys
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in choice.keys
    assert not any("gate.weight" == k.rsplit(".", 2)[-2] + ".weight" for k in choice.keys)


def test_quantize_keyword_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="quantize"):
        streamload.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "o", quantize="int4")
