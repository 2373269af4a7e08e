"""torchtitan 0.3.0 as a client: its own Qwen3 models (fused QKV; per-expert MoE),
parallelised with its own functions on 2 and 4 gloo ranks, loaded by streamload from a
hub checkpoint with torchtitan's state-dict adapter as the mapping, bit for bit with
torchtitan's own HF load (parameters, buffers, logits); mappings with no exact region
form are a MappingError on every rank; no transformers import for a torchtitan model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# Skipped only where torchtitan is not installed at all: an installed torchtitan that fails to
# import (a dependency missing from the clients extra) is an error, never a silent skip.
if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is a clients extra (.ci/clients-nodeps.txt)", allow_module_level=True)
import cases_titan as cases  # noqa: E402
import titan_models as tm  # noqa: E402
import torchtitan.models.qwen3  # noqa: E402, F401 - fails loudly when a dependency is missing
from rank_group import RankGroup  # noqa: E402

import streamload  # noqa: E402
from streamload.io.copy_ops import bit_view as bits  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("titan")
    kinds = ("dense", "moe", "untied")
    return {kind: tm.write_checkpoint(root / kind, kind, seed=11 + i) for i, kind in enumerate(kinds)}


# 2 ranks in the default run; 3 (odd: every dim shards unevenly) and 4 (TP x FSDP) with --runslow.
@pytest.fixture(
    scope="module",
    params=[2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)],
)
def group(request: pytest.FixtureRequest):
    g = RankGroup(request.param)
    yield g
    g.close()


def test_per_expert_checkpoint(ckpts: dict[str, str]) -> None:
    """The MoE checkpoint stores experts one tensor each (what the stacking is for)."""
    index = (Path(ckpts["moe"]) / "model.safetensors.index.json").read_text()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mapping_matches_adapter_one_process(ckpts: dict[str, str], kind: str) -> None:
    """The region form of the adapter (plus the fused-QKV hook) equals ``from_hf`` + ``load_state_dict``."""
    cfg = tm.titan_config(kind)
    ref = tm.titan_reference(cfg, ckpts[kind])
    model = tm.build_meta(cfg)
    report = streamload.load_checkpoint(model, ckpts[kind], mapping=tm.adapter_for(cfg))
    assert cases.compare(model, ref) == []
    assert report.missing_keys == []
    if kind == "dense":
        assert model.lm_head.weight is model.tok_embeddings.weight
    x = tm.tokens()
    assert torch.equal(bits(tm.forward_logits(model, x)), bits(tm.forward_logits(ref, x)))


def test_dict_and_callable_mappings(ckpts: dict[str, str]) -> None:
    """The template dict and a rename callable (no adapter) give the same bytes as the adapter."""
    import re

    cfg = tm.titan_config("dense")
    ref = tm.titan_reference(cfg, ckpts["dense"])
    table = dict(tm.adapter_for(cfg).from_hf_map)
    rules = [(re.compile("^" + re.escape(k).replace(r"\{\}", r"(\d+)") + "$"), v) for k, v in table.items()]

    def rename(key: str) -> str | None:
        for pattern, name in rules:
            m = pattern.match(key)
            if m:
                return None if name is None else name.format(*m.groups())
        return key

    for mapping in (table, rename):
        model = tm.build_meta(cfg)
        streamload.load_checkpoint(model, ckpts["dense"], mapping=mapping)
        assert cases.compare(model, ref) == []
        assert model.lm_head.weight is model.tok_embeddings.weight


def test_extra_checkpoint_tensor(ckpts: dict[str, str], tmp_path: Path) -> None:
    """A tensor the adapter does not map: unexpected (strict raises), ignored with unexpected="ignore"."""
    import json
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / "extra"
    shutil.copytree(ckpts["dense"], path)
    save_file({"mtp.proj.weight": torch.ones(3, 2)}, str(path / "extra.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.proj.weight"] = "extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = tm.titan_config("dense")
    with pytest.raises(streamload.KeyMismatchError, match="mtp.proj.weight"):
        streamload.load_checkpoint(tm.build_meta(cfg), str(path), mapping=tm.adapter_for(cfg))
    model = tm.build_meta(cfg)
    report = streamload.load_checkpoint(model, str(path), mapping=tm.adapter_for(cfg), unexpected="ignore")
    assert report.unexpected_keys == ["mtp.proj.weight"]
    assert cases.compare(model, tm.titan_reference(cfg, ckpts["dense"])) == []


def test_meta_build_buffers_not_garbage(ckpts: dict[str, str]) -> None:
    """strict=False on a meta build: rope cache, tokens_per_expert and expert_bias are
    recomputed by their modules, equal to torchtitan's init (the issue saw ~1e17)."""
    cfg = tm.titan_config("moe")
    model = tm.build_meta(cfg)
    streamload.load_checkpoint(model, ckpts["moe"], mapping=tm.adapter_for(cfg), strict=False)
    ref = tm.titan_reference(cfg, ckpts["moe"])
    for name, b in model.named_buffers():
        assert torch.equal(bits(b), bits(ref.get_buffer(name))), name
    assert any(n.endswith("rope.cache") for n, _ in model.named_buffers())


def test_missing_parameter_is_loud(ckpts: dict[str, str]) -> None:
    """A parameter the mapping does not produce is missing: KeyMismatchError, not a silent init."""
    cfg = tm.titan_config("dense")
    mapping = dict(tm.adapter_for(cfg).from_hf_map)
    mapping["model.norm.weight"] = None
    with pytest.raises(streamload.KeyMismatchError, match="norm.weight"):
        streamload.load_checkpoint(tm.build_meta(cfg), ckpts["dense"], mapping=mapping)


def test_value_transforming_adapter_is_refused(ckpts: dict[str, str]) -> None:
    """llama3's from_hf permutes q/k rows (same names and shapes): not a region map, so loud."""
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    adapter = Llama3StateDictAdapter(llama3_configs["debugmodel"](attn_backend="flex"), None)
    cfg = tm.titan_config("dense")
    with pytest.raises(streamload.MappingError, match="llama3"):
        streamload.load_checkpoint(tm.build_meta(cfg), ckpts["dense"], mapping=adapter)


def test_no_transformers_import(ckpts: dict[str, str]) -> None:
    """Loading a torchtitan model never imports transformers (seconds of a load)."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import titan_models as tm
        import streamload
        cfg = tm.titan_config("moe")
        streamload.load_checkpoint(tm.build_meta(cfg), {ckpts["moe"]!r}, mapping=tm.adapter_for(cfg))
        assert "transformers" not in sys.modules, "transformers was imported"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fsdp_bit_exact(group: RankGroup, ckpts: dict[str, str], kind: str) -> None:
    """torchtitan's parallelize_qwen3 (FSDP over every rank), meta build, strict load."""
    out = group.run(cases.case_titan_load, timeout=300, kind=kind, path=ckpts[kind])
    for r in out:
        assert r["bad"] == [] and r["logits_equal"] and r["missing"] == [], r
        assert r["tied"] is (kind == "dense")


def test_moe_init_first_keeps_bias(group: RankGroup, ckpts: dict[str, str]) -> None:
    """torchtitan's own order (init_weights, then the checkpoint): expert_bias_E is kept."""
    out = group.run(cases.case_titan_load, timeout=300, kind="moe", path=ckpts["moe"], init_first=True)
    assert all(r["bad"] == [] and r["logits_equal"] for r in out), out


def test_tp_fsdp_bit_exact(group: RankGroup, ckpts: dict[str, str]) -> None:
    """TP 2 x FSDP (world // 2) with torchtitan's own plan (the fused QKV column-sharded, as a
    _StridedShard x Shard DTensor), untied embeddings (TP unties a tied model: next test)."""
    if group.world < 4:
        pytest.skip("TP x FSDP needs 4 ranks")
    out = group.run(cases.case_titan_load, timeout=300, kind="untied", path=ckpts["untied"], tp=2)
    for r in out:
        assert r["bad"] == [] and r["logits_equal"] and not r["tied"], r
        # 2-D placements (FSDP x TP) really were loaded, not FSDP alone.
        assert any(p.count("Shard") == 2 for p in r["placements"]), r["placements"]


def test_tp_untied_is_tie_error(group: RankGroup, ckpts: dict[str, str]) -> None:
    """TP gives lm_head its own parameter on a meta build: a TieError on every rank, not an untie."""
    if group.world < 4:
        pytest.skip("TP x FSDP needs 4 ranks")
    out = group.run(cases.case_titan_tp_untied, timeout=300, path=ckpts["dense"])
    assert all(r.startswith("TieError meta=True") for r in out), out


@pytest.mark.parametrize("how", ["swapped_qk", "collide", "unknown_hook"])
def test_bad_mapping_on_every_rank(group: RankGroup, ckpts: dict[str, str], how: str) -> None:
    out = group.run(cases.case_titan_bad_mapping, timeout=300, path=ckpts["dense"], how=how)
    assert all(r.startswith("MappingError meta=True") for r in out), out
