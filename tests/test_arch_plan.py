"""Pure tests (no processes) of what the architecture sweep relies on: the
generic config shrinker, Split in region algebra, op outputs named as
transformers names them, and non-persistent buffers computed as
from_pretrained computes them."""

from __future__ import annotations

import warnings

import pytest
import torch

from streamload.plan.convert import Sym, _full_names, apply_ops_symbolically
from streamload.plan.regions import identity_piece
from streamload.tools.archs import _shrink_dict, alias_groups, differing, shrink_config


def test_shrink_keeps_every_layer_kind_and_relations() -> None:
    llama = shrink_config("llama")
    assert (llama.num_hidden_layers, llama.hidden_size, llama.vocab_size) == (2, 32, 128)
    # olmo_hybrid's first attention layer is its fourth: the prefix keeps it.
    hybrid = shrink_config("olmo_hybrid")
    assert len(hybrid.layer_types) == hybrid.num_hidden_layers
    assert len(set(hybrid.layer_types)) > 1
    # A multi-head default stays multi-head; a per-layer dict keeps only kept layers.
    from transformers import AutoConfig

    dots = _shrink_dict(AutoConfig.for_model("dots3_note_text").to_dict(), 2)
    assert dots["num_key_value_heads"] == dots["num_attention_heads"] == 4
    assert all(int(k) < dots["num_hidden_layers"] for k in dots["per_layer_config"])
    assert all(v["num_attention_heads"] == 4 for v in dots["per_layer_config"].values())


def _split_converter():
    from transformers.core_model_loading import Split, WeightConverter

    return WeightConverter(
        source_patterns="query_key_value",
        target_patterns=["q_proj", "k_proj", "v_proj"],
        operations=[Split(dim=0)],
    )


def test_split_streams_like_torch_split() -> None:
    """Each target's pieces read exactly the rows torch.split gives it."""
    src = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    shapes = {f"l.0.{t}.weight": (n, 3) for t, n in (("q_proj", 6), ("k_proj", 2), ("v_proj", 2))}
    leaves = {"query_key_value": [Sym((10, 3), [identity_piece("qkv", (10, 3))])]}
    outs = apply_ops_symbolically(_split_converter(), leaves, {}, None, "l.0.q_proj.weight", shapes)
    expect = torch.split(src, [6, 2, 2], dim=0)
    for (key, sym), want in zip(outs.items(), expect, strict=True):
        got = torch.empty(sym.shape)
        for p in sym.pieces:
            region = src[tuple(slice(s, s + n) for s, n in zip(p.src_start, p.shape, strict=True))]
            got[tuple(slice(s, s + n) for s, n in zip(p.dst_start, p.shape, strict=True))] = region
        assert torch.equal(got, want), key


def test_split_that_torch_would_refuse_is_not_streamed() -> None:
    from streamload.plan.convert import NotStreamable

    shapes = {f"l.0.{t}.weight": (4, 3) for t in ("q_proj", "k_proj", "v_proj")}
    leaves = {"query_key_value": [Sym((10, 3), [identity_piece("qkv", (10, 3))])]}
    with pytest.raises(NotStreamable):
        apply_ops_symbolically(_split_converter(), leaves, {}, None, "l.0.q_proj.weight", shapes)


def test_output_names_follow_transformers() -> None:
    """Prefix and suffix come from the first output key found in the layer name
    (WeightConverter.convert), and apply to every output."""
    keys = ["self_attn.gate_proj.weight", "self_attn.q_proj.weight"]
    full = _full_names("model.L.layers.3.self_attn.gate_proj.weight", keys)
    assert full == {k: "model.L.layers.3." + k for k in keys}
    assert _full_names("model.layers.*.mlp.experts.gate_up_proj", ["gate_up_proj"]) == {
        "gate_up_proj": "model.layers.0.mlp.experts.gate_up_proj"
    }


def test_buffers_as_from_pretrained_gives_them() -> None:
    """codegen builds embed_positions in __init__ under the load dtype (bf16 here);
    from_pretrained recomputes it after the dtype context closes. The restore
    must give from_pretrained's values, leaving loaded parameters alone."""
    from transformers import AutoModelForCausalLM

    from streamload.model.hf import init_buffers_like_from_pretrained

    cfg = shrink_config("codegen")
    name = "transformer.rotary_emb.embed_positions"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        # Built under a float32 default, the buffer is what from_pretrained computes.
        want = dict(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).named_buffers())[name]
    from_init = dict(built.named_buffers())[name].clone()
    assert not torch.equal(from_init, want), "the bf16-built buffer should differ (else this proves nothing)"
    before = {n: p.detach().clone() for n, p in built.named_parameters()}
    assert init_buffers_like_from_pretrained(built) == []
    assert torch.equal(dict(built.named_buffers())[name], want)
    assert all(torch.equal(p, before[n]) for n, p in built.named_parameters())
    assert init_buffers_like_from_pretrained(torch.nn.Linear(2, 2)) is None


def test_alias_groups_and_differing() -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    seq = torch.nn.Sequential(a, b)
    assert alias_groups(seq) == []
    b.weight = a.weight
    assert alias_groups(seq) == [["0.weight", "1.weight"]]
    other = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert "0.weight" in differing(seq, other)
    assert differing(seq, seq) == []
