"""`streamload inspect` shows quantized groups; `streamload ingest --dtype
bfloat16` writes a dequantized checkpoint equal, bit for bit, to what
transformers' dequantizing from_pretrained holds."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamload.io.copy_ops import bit_view
from streamload.tools.cli import main
from streamload.tools.quantized import make_fp8_checkpoint, make_mxfp4_checkpoint

ATTN = dict(num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_checkpoint(
        tmp_path_factory.mktemp("q") / "ds", "deepseek_v3", hidden_size=256, intermediate_size=256,
        moe_intermediate_size=128, n_routed_experts=3, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=96, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1, seed=8, max_shard_size="300KB",
    )  # fmt: skip


def _load(path: Path) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).state_dict()


def test_inspect_shows_quantized_groups(fp8_moe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(fp8_moe)]) == 0
    out = capsys.readouterr().out
    assert "quantized groups (fp8" in out
    assert "model.layers.*.mlp.experts.*.gate_proj.weight  fp8_block block=128x128 tensors=3" in out


def test_inspect_mxfp4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_mxfp4_checkpoint(
        tmp_path / "mx", hidden_size=64, intermediate_size=64, num_local_experts=2, num_experts_per_tok=1,
        head_dim=16, layer_types=["full_attention", "full_attention"], **ATTN,
    )  # fmt: skip
    assert main(["inspect", str(ckpt)]) == 0
    assert "model.layers.*.mlp.experts.gate_up_proj  mxfp4 block=1x32 tensors=2" in capsys.readouterr().out


@pytest.mark.parametrize("fallback", [False, True])
def test_ingest_writes_the_dequantized_fused_checkpoint(
    fp8_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    """With ``fallback``, every converter runs transformers' own ops (as for an
    op with no streaming form): their fp8 inputs must still be dequantized."""
    from streamload.plan import convert

    if fallback:

        def not_streamable(*args: object, **kwargs: object) -> dict:
            raise convert.NotStreamable("forced by the test")

        monkeypatch.setattr(convert, "apply_ops_symbolically", not_streamable)
    dst = tmp_path / "bf16"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["ingest", str(fp8_moe), str(dst), "--dtype", "bfloat16"]) == 0
    assert fallback == any("no streaming form" in str(w.message) for w in caught)
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in cfg
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert not any("scale_inv" in k for k in index["weight_map"])
    assert any(k.endswith("experts.gate_up_proj") for k in index["weight_map"])  # fused
    ours, ref = _load(dst), _load(fp8_moe)
    assert ours.keys() == ref.keys()
    # --dtype casts every floating tensor, so modules transformers keeps in
    # float32 (DeepSeek's router) hold bf16-rounded values after an ingest.
    bad = [
        k
        for k in ref
        if not torch.equal(bit_view(ours[k]), bit_view(ref[k].to(torch.bfloat16).to(ref[k].dtype)))
    ]
    assert not bad


def _fp8_llama(tmp_path: Path) -> Path:
    return make_fp8_checkpoint(
        tmp_path / "l", "llama", hidden_size=256, intermediate_size=256, seed=9, **ATTN
    )


def test_keep_quantized_loads_values_and_scales_as_they_are(tmp_path: Path) -> None:
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from transformers import AutoConfig

    import streamload
    from streamload.errors import DTypeMismatchError

    ckpt = _fp8_llama(tmp_path)
    state = load_file(str(ckpt / "model.safetensors"))
    cfg = AutoConfig.from_pretrained(str(ckpt))

    def skeleton(fp8: bool) -> torch.nn.Module:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        for name, t in state.items():
            if fp8 and name.endswith("weight_scale_inv"):
                mod = model.get_submodule(name.rsplit(".", 1)[0])
                fp8_weight = torch.empty(mod.weight.shape, dtype=torch.float8_e4m3fn, device="meta")
                mod.weight = torch.nn.Parameter(fp8_weight, requires_grad=False)
                mod.register_parameter(
                    "weight_scale_inv", torch.nn.Parameter(torch.empty(t.shape, device="meta"))
                )
        return model

    model = skeleton(fp8=True)
    rep = streamload.load_checkpoint(model, str(ckpt), quantized="keep", progress=False)
    assert not rep.unexpected_keys and not rep.missing_keys
    sd = model.state_dict()
    for name, t in state.items():
        assert sd[name].dtype == t.dtype and torch.equal(bit_view(sd[name]), bit_view(t)), name
    with pytest.raises(DTypeMismatchError, match="quantized='keep' needs a F8_E4M3 parameter"):
        streamload.load_checkpoint(
            skeleton(fp8=False), str(ckpt), quantized="keep", progress=False, strict=False
        )
    # The default dequantizes into the bf16 skeleton, as transformers does.
    model = skeleton(fp8=False)
    streamload.load_checkpoint(model, str(ckpt), progress=False)
    ref = _load(ckpt)
    assert all(torch.equal(bit_view(v), bit_view(ref[k])) for k, v in model.state_dict().items())


@pytest.mark.parametrize("drop_cache", [False, True])
def test_cold_reads_dequantize_like_mapped_ones(fp8_moe: Path, drop_cache: bool) -> None:
    """read_mode='cold' wraps the native engine; dequantizing ops must still run, bit-exact."""
    from transformers import AutoConfig

    from streamload.io.checkpoint import Checkpoint
    from streamload.io.dequant import read_dequantized
    from streamload.plan.quant import quantized_view, scheme_from_config

    scheme = scheme_from_config(AutoConfig.from_pretrained(str(fp8_moe)))
    mapped = Checkpoint(fp8_moe, mode="mmap")
    cold = Checkpoint(fp8_moe, mode="cold", drop_cache=drop_cache)
    table = {t.name: (t.dtype, tuple(t.shape), t.file) for t in mapped.tensors}
    _, quant = quantized_view(table, scheme)
    assert quant
    for q in quant.values():
        assert torch.equal(bit_view(read_dequantized(cold, q)), bit_view(read_dequantized(mapped, q)))
