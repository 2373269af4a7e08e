"""The sync's checks that need no engine: the engine's expected hub tensors from its config,
a mismatch named with its lists, tie aliases from the engine's module tree."""

from __future__ import annotations

import pytest

from streamload import EngineMismatchError
from streamload.save.layout import output_layout
from streamload.sync.driver import check_engine
from streamload.sync.vllm_engine import tie_aliases
from streamload.tools.synthetic import make_config


def _model(**kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(make_config("qwen3_moe", **{"tie": True, "num_experts": 3, **kw}))


def test_engine_of_the_same_config_passes() -> None:
    m = _model()
    check_engine(output_layout(m), m.config.to_dict())


def test_engine_shapes_and_names_that_differ_are_named() -> None:
    trainer = _model()
    engine = _model(moe_intermediate_size=24, num_experts=4).config.to_dict()
    with pytest.raises(EngineMismatchError) as info:
        check_engine(output_layout(trainer), engine, rank=1)
    e = info.value
    assert e.rank == 1 and "rank 1" in str(e)
    assert e.missing and all(".experts.3." in k for k in e.missing)  # the engine's fourth expert
    assert not e.unexpected
    assert e.shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == ((32, 16), (32, 24))


def test_tie_aliases_keep_only_names_the_hub_lacks() -> None:
    ties = [
        ["lm_head.weight", "model.embed_tokens.weight"],
        ["model.a.weight", "model.b.weight"],  # none of them sent: nothing to alias
    ]
    hub = ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"]
    assert tie_aliases(ties, hub) == {"model.embed_tokens.weight": ["lm_head.weight"]}
