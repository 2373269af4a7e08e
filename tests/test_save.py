"""streamload.save_pretrained: the output is transformers' own save of the gathered
model, byte for byte (layout in one process, round trips over gloo ranks)."""

from __future__ import annotations

import json
import os
import struct
import warnings

import cases_save as cases
import pytest
import torch
from rank_group import RankGroup
from safetensors.torch import save

import streamload
from streamload.save.layout import header_bytes, output_layout
from streamload.tools.synthetic import make_checkpoint

MODELS = {
    "qwen2": dict(tie=True),  # dense, tied embeddings
    "llama": dict(tie=False),  # dense, untied
    "qwen3_moe": dict(num_experts=5, tie=True),  # fused experts <- per-expert tensors
    "mixtral": dict(num_local_experts=3, tie=False),  # fused experts + w1/w2/w3 renames
    "qwen2_moe": dict(num_experts=5, tie=False),  # shared expert, attention biases
    "olmoe": dict(num_experts=6, tie=True),
}


def _model(mt: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A tiny random model as transformers' ``from_pretrained`` gives it (a loaded model is
    saved in natural key order; see layout._as_loaded)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = make_checkpoint(
            tempfile.mkdtemp(prefix="streamload_src_"), mt, dtype=dtype, seed=seed, **MODELS[mt]
        )
        return AutoModelForCausalLM.from_pretrained(d, dtype="auto")


def _files(d) -> dict[str, bytes]:
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def test_header_bytes_match_safetensors() -> None:
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.int32]
    dtypes += [torch.float32, torch.float64, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2]
    tensors = {f"t{i:02d}.w": torch.zeros(3, i + 1, dtype=dt) for i, dt in enumerate(reversed(dtypes))}
    tensors["scalar"] = torch.zeros((), dtype=torch.float32)
    blob = save(tensors, metadata={"format": "pt"})
    n = struct.unpack("<Q", blob[:8])[0]
    from streamload.io.copy_ops import ST_DTYPES

    mine, _ = header_bytes([(k, ST_DTYPES[t.dtype], tuple(t.shape)) for k, t in tensors.items()])
    assert mine == blob[: 8 + n]


@pytest.mark.parametrize("mt", list(MODELS))
@pytest.mark.parametrize("shard", ["20KB", "5GB"])
def test_layout_matches_transformers(tmp_path, mt: str, shard: str) -> None:
    m = _model(mt)
    m.save_pretrained(tmp_path, max_shard_size=shard)
    lay = output_layout(m, max_shard_size=shard)
    files = _files(tmp_path)
    names = [f.name for f in lay.files] + (["model.safetensors.index.json"] if lay.index else [])
    assert sorted(names) == sorted(f for f in files if f.startswith("model"))
    assert (len(lay.files) > 1) == (shard == "20KB")
    for f in lay.files:
        assert files[f.name][: len(f.header)] == f.header
        assert len(files[f.name]) == f.size
    if lay.index is not None:
        assert files["model.safetensors.index.json"] == lay.index
        assert json.loads(lay.index)["weight_map"] == {k: t.file for k, t in lay.tensors.items()}
    if "experts" in str(list(dict(m.named_parameters()))):
        assert any(".experts.0." in k for k in lay.tensors), "experts not reverted to per-expert tensors"


@pytest.mark.parametrize("mt", list(MODELS))
def test_single_process_plain_model_equals_transformers(tmp_path, mt: str) -> None:
    m = _model(mt, seed=5)
    m.save_pretrained(tmp_path / "ref", max_shard_size="20KB")
    rep = streamload.save_pretrained(m, tmp_path / "out", max_shard_size="20KB", bucket_bytes=4096)
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")
    assert rep.writers == "owners" and rep.peak_buffer_bytes <= 4096
    assert "config.json" in rep.files and rep.bytes_written > 0


def test_single_process_cast_and_replace(tmp_path) -> None:
    m = _model("qwen3_moe", dtype=torch.float32, seed=7)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    streamload.save_pretrained(m, out, dtype=torch.bfloat16, max_shard_size="20KB")
    m.to(torch.bfloat16).save_pretrained(tmp_path / "ref", max_shard_size="20KB")
    # torch's rounding; the weights replaced, a file the save does not write kept (as transformers).
    assert _files(out) == {**_files(tmp_path / "ref"), "stale.txt": b"old"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("save_src")
    return {
        mt: str(make_checkpoint(root / mt, mt, seed=21 + i, max_shard_size="24KB", **kw))
        for i, (mt, kw) in enumerate(MODELS.items())
    }


@pytest.fixture(scope="module")
def group():
    g = RankGroup(3)
    yield g
    g.close()


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("mt", list(MODELS))
def test_round_trip(group: RankGroup, ckpts, tmp_path, ws: int, mt: str) -> None:
    res = group.run(cases.case_round_trip, ckpt=ckpts[mt], ws=ws, out=str(tmp_path / "out"), timeout=90)
    assert res[0]["files"] and all(r["report"].writers == "owners" for r in res[:ws])
    assert all(sorted(r["report"].files) == res[0]["files"] for r in res[:ws])  # the same list on every rank
    assert sum(r["report"].bytes_written for r in res[:ws]) == sum(
        os.path.getsize(tmp_path / "out" / f) for f in res[0]["files"] if f.endswith(".safetensors")
    )


@pytest.mark.parametrize("ws", [2, 3])
def test_round_trip_casts(group: RankGroup, ckpts, tmp_path, ws: int) -> None:
    # bf16 model saved as float32; float32 masters saved as bf16 (torch's rounding).
    group.run(
        cases.case_round_trip,
        ckpt=ckpts["qwen3_moe"],
        ws=ws,
        out=str(tmp_path / "a"),
        save_dtype=torch.float32,
    )
    group.run(
        cases.case_round_trip,
        ckpt=ckpts["qwen2"],
        ws=ws,
        out=str(tmp_path / "b"),
        load_dtype=torch.float32,
        save_dtype=torch.bfloat16,
    )


def test_round_trip_after_optimizer_step(group: RankGroup, ckpts, tmp_path) -> None:
    for mt in ("qwen2", "mixtral"):
        group.run(
            cases.case_round_trip,
            ckpt=ckpts[mt],
            ws=3,
            out=str(tmp_path / mt),
            load_dtype=torch.float32,
            step=True,
        )


def test_no_full_tensor_buffer(group: RankGroup, ckpts, tmp_path) -> None:
    bucket = 1024
    for mt in ("llama", "qwen3_moe"):
        res = group.run(
            cases.case_round_trip,
            ckpt=ckpts[mt],
            ws=3,
            out=str(tmp_path / mt),
            bucket_bytes=bucket,
            track=True,
        )
        for r in res:
            assert r["largest"] > 4 * bucket  # a whole parameter would not fit the bucket
            assert 0 < r["report"].peak_buffer_bytes <= bucket
            # no op of the save allocated more than the bucket (a gathered parameter would)
            assert 0 < r["allocated"] <= bucket, r["allocated"]


@pytest.mark.parametrize("ws", [2, 3])
def test_plain_module_tensor_parallel_placements(group: RankGroup, tmp_path, ws: int) -> None:
    res = group.run(cases.case_plain_tp, ws=ws, out=str(tmp_path / "o"))
    # every byte written once: the replicated tensor and the buffer by one rank only
    assert sum(r["report"].bytes_written for r in res[:ws]) == os.path.getsize(
        tmp_path / "o" / "model.safetensors"
    )
    assert all(r["report"].writes > 0 for r in res[:ws])


def test_file_runs() -> None:
    from streamload.save.layout import HubTensor
    from streamload.save.write import file_runs

    h = HubTensor("w", "F32", (4, 3, 2), "f", 64)
    assert file_runs(h, ((0, 4), (0, 3), (0, 2))) == [(64, 96)]
    assert file_runs(h, ((1, 3), (0, 3), (0, 2))) == [(64 + 24, 48)]
    assert file_runs(h, ((0, 2), (1, 2), (0, 2))) == [(64 + 8, 8), (64 + 32, 8)]
    assert file_runs(h, ((3, 4), (2, 3), (1, 2))) == [(64 + 23 * 4, 4)]


@pytest.mark.parametrize("where", ["plan_save", "write_owners"])
def test_one_rank_failure_is_one_error_everywhere(group: RankGroup, tmp_path, where: str) -> None:
    res = group.run(cases.case_one_rank_fails, ws=3, out=str(tmp_path / "o"), where=where, timeout=60)
    assert all("No space left" in r["error"] for r in res)


def test_interrupt_while_planning_on_one_rank(group: RankGroup, tmp_path) -> None:
    res = group.run(
        cases.case_one_rank_fails,
        ws=3,
        out=str(tmp_path / "o"),
        where="plan_save",
        interrupt=True,
        timeout=60,
    )
    assert "KeyboardInterrupt" in res[0]["error"] and res[2]["error"] == "KeyboardInterrupt()"


def test_op_with_no_region_form_is_a_named_error(tmp_path) -> None:
    # inkling2's experts are interleaved (transformers' Interleave): the loader materialises
    # them on its reader; a save refuses before writing anything.
    from transformers import AutoModelForCausalLM

    from streamload.tools.archs import build_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_checkpoint("inkling2_text", tmp_path / "src")
        m = AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    with pytest.raises(streamload.StreamloadError, match="Interleave, which has no region form") as info:
        streamload.save_pretrained(m, tmp_path / "out")
    assert "gate_up_proj" in str(info.value) and sorted(os.listdir(tmp_path)) == ["src"]


# A key rename on a hybrid stack, a legacy key mapping, fused projections split by their
# targets' sizes from a per-expert MoE, a composite model tied through its top config,
# Conv1D blocks under transformer.h.
FAST = ["bailing_hybrid", "fuyu", "sarvam_moe", "moss_transcribe_diarize", "gpt2"]


def _arch_equal(mt: str, root) -> str:
    """'' when streamload's save of transformers' loaded ``mt`` equals transformers' own save."""
    from transformers import AutoModelForCausalLM

    from streamload.tools.archs import Skip, build_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            build_checkpoint(mt, root / "src")
        except Skip as why:
            return f"skip: {why}"
        m = AutoModelForCausalLM.from_pretrained(root / "src")
        m.save_pretrained(root / "ref", max_shard_size="100KB")
    streamload.save_pretrained(m, root / "out", max_shard_size="100KB")
    bad = sorted(set(_files(root / "ref").items()) ^ set(_files(root / "out").items()))
    return f"differ: {[f for f, _ in bad][:4]}" if bad else ""


@pytest.mark.parametrize("mt", FAST)
def test_representative_architectures_single_process(tmp_path, mt: str) -> None:
    assert _arch_equal(mt, tmp_path) == ""


@pytest.mark.parametrize("mt", FAST)
def test_representative_architectures_round_trip(group: RankGroup, tmp_path, mt: str) -> None:
    from streamload.tools.archs import build_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_checkpoint(mt, tmp_path / "src")
    group.run(cases.case_round_trip, ckpt=str(tmp_path / "src"), ws=3, out=str(tmp_path / "out"), timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_every_causal_lm_architecture_saves_as_transformers(tmp_path) -> None:
    from streamload.tools.archs import causal_lm_types

    outcomes = {}
    for i, mt in enumerate(causal_lm_types()):
        try:
            outcomes[mt] = _arch_equal(mt, tmp_path / str(i))
        except streamload.StreamloadError as exc:  # refused by name (an op with no region form)
            outcomes[mt] = f"refused: {exc.reason}"
    failed = {mt: why for mt, why in outcomes.items() if why.startswith("differ")}
    refused = {mt: why for mt, why in outcomes.items() if why.startswith("refused")}
    assert not failed, failed
    assert sum(why == "" for why in outcomes.values()) > len(outcomes) // 2, outcomes
    assert set(refused) <= {"inkling2_text", "inkling2_loop_text", "inkling2"}, refused


def test_overlapping_pieces_whose_sizes_add_up_are_refused() -> None:
    """Two pieces of one hub tensor that overlap while their element counts add up to the
    tensor's (one row written twice, another never) are a SaveError naming the tensor and both
    boxes; the exact tiling passes."""
    from streamload.errors import SaveError
    from streamload.plan.regions import SourcePiece
    from streamload.save.plan import _check_once

    table = {"w": ("F32", (4, 2), "model.safetensors")}

    def rows(lo: int, n: int) -> SourcePiece:
        return SourcePiece("w", (0, 0), (n, 2), (lo, 0), (0, 1))

    _check_once({"a": (rows(0, 2),), "b": (rows(2, 2),)}, table)  # exact tiling
    # rows 0:2 and 1:3 overlap on row 1 and leave row 3 unwritten: 4 + 4 == 8 elements.
    with pytest.raises(SaveError) as err:
        _check_once({"a": (rows(0, 2),), "b": (rows(1, 2),)}, table)
    assert err.value.tensor == "w"
    assert "[0:2, 0:2]" in str(err.value) and "[1:3, 0:2]" in str(err.value), err.value
    # Pieces in model dims that walk the hub dims transposed (dims (1, 0)) are compared in hub dims.
    t = {
        "a": (SourcePiece("w", (0, 0), (2, 2), (0, 0), (1, 0)),),
        "b": (SourcePiece("w", (0, 0), (2, 2), (1, 0), (1, 0)),),
    }
    with pytest.raises(SaveError, match="same elements"):
        _check_once(t, table)
    # Too few elements, no overlap: still refused.
    with pytest.raises(SaveError, match="cover 4 of 8"):
        _check_once({"a": (rows(0, 2),)}, table)


def test_layout_without_huggingface_hub_is_a_save_error(monkeypatch) -> None:
    """Without huggingface_hub (not a core dependency) the layout is a SaveError whose hint
    names the [hf] extra, not an ImportError from deep inside the save."""
    import sys

    from streamload.errors import SaveError

    monkeypatch.setitem(sys.modules, "huggingface_hub.serialization._base", None)
    with pytest.raises(SaveError) as err:
        output_layout(torch.nn.Linear(2, 2))
    assert err.value.hint is not None and "streamload[hf]" in err.value.hint


def test_extra_files_commit_with_the_weights_or_not_at_all(group: RankGroup, tmp_path) -> None:
    """Rank 0's extra files (a tokenizer) are part of the commit: a failure in them, half a file
    written, leaves the previous checkpoint byte for byte (3 ranks)."""
    res = group.run(cases.case_extra_files, ws=3, out=str(tmp_path / "o"), timeout=60)
    for r in res:
        assert "tokenizer.json" in r["names"] and r["tokenizer"] == b'{"version": 1, "vocab": {}}', r
        assert r["left"] == ["o"], r  # no temporary directory left
