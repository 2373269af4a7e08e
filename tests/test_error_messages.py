"""The errors a user meets first name what they concern and say what to do next.

Each case builds the bad input (a tiny random checkpoint, altered), calls the public entry
in this one process (no torch.distributed: the loader runs as a group of one) and checks
the error class, the tensor or file named, and the hint line. The same hints crossing
ranks: tests/test_faults.py (missing_shard, missing_tensor, wrong_shape_in_config).
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import streamload
from streamload.tools.synthetic import make_checkpoint, make_config

SIZES: dict[str, int] = dict(layers=2, vocab=64)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer qwen2 checkpoint in several shards, with its index and config.json."""
    out = tmp_path_factory.mktemp("ckpt") / "base"
    return make_checkpoint(out, "qwen2", seed=3, max_shard_size="8KB", layers=2, vocab=64)


def _copy(base: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(base, out)
    return out


def _model(**overrides: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kw = {**SIZES, **overrides}
    return AutoModelForCausalLM.from_config(make_config("qwen2", **kw))  # type: ignore[arg-type]


def _hint(err: pytest.ExceptionInfo[streamload.StreamloadError]) -> str:
    """The hint, checked to be the message's second and last line."""
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and lines[1] == f"  hint: {err.value.hint}", lines
    return str(err.value.hint)


# -- the path --------------------------------------------------------------------


def test_hub_id_says_download_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no local "Qwen/" directory can shadow the id
    with pytest.raises(streamload.CheckpointError, match="no such checkpoint file or directory") as err:
        streamload.from_pretrained("Qwen/Qwen2-0.5B")
    assert err.value.file == "Qwen/Qwen2-0.5B"
    assert "`hf download Qwen/Qwen2-0.5B --local-dir DIR` and pass DIR" in _hint(err)
    with pytest.raises(streamload.CheckpointError) as err:
        streamload.Checkpoint("Qwen/Qwen2-0.5B")
    assert "Hugging Face Hub id" in _hint(err)


def test_missing_directory_says_what_to_pass(tmp_path: Path) -> None:
    gone = tmp_path / "no_such_ckpt"
    with pytest.raises(streamload.CheckpointError, match="no such checkpoint") as err:
        streamload.load_checkpoint(_model(), gone)
    assert str(gone) in str(err.value)
    assert "local directory holding config.json and the *.safetensors files" in _hint(err)
    with pytest.raises(streamload.CheckpointError) as err:
        streamload.Checkpoint("~/models/qwen")
    assert "os.path.expanduser" in _hint(err)


def test_pytorch_bin_only_says_convert(base: Path, tmp_path: Path) -> None:
    d = tmp_path / "bin_only"
    d.mkdir()
    shutil.copy(base / "config.json", d)
    torch.save({"model.norm.weight": torch.ones(4)}, d / "pytorch_model.bin")
    with pytest.raises(streamload.CheckpointError, match=r"no \.safetensors files") as err:
        streamload.from_pretrained(d)
    assert err.value.file == str(d)
    hint = _hint(err)
    assert "found pytorch_model.bin" in hint and "reads safetensors only" in hint
    assert f"from_pretrained('{d}').save_pretrained('{d}-safetensors')" in hint


def test_parent_of_the_files_points_at_them(base: Path, tmp_path: Path) -> None:
    # The hub cache's layout: the files sit in snapshots/<revision>/ below the repo folder.
    repo = tmp_path / "models--Qwen--tiny"
    snap = repo / "snapshots" / "0123abc"
    shutil.copytree(base, snap)
    with pytest.raises(streamload.CheckpointError, match=r"no \.safetensors files") as err:
        streamload.Checkpoint(repo)
    assert _hint(err) == f"found safetensors files in {snap}: pass that directory"
    (tmp_path / "empty").mkdir()
    with pytest.raises(streamload.CheckpointError) as err:
        streamload.Checkpoint(tmp_path / "empty")
    assert "hf download REPO --local-dir DIR" in _hint(err)


def test_file_the_index_names_is_missing(base: Path, tmp_path: Path) -> None:
    d = _copy(base, tmp_path, "partial")
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    victim = weight_map["model.norm.weight"]
    (d / victim).unlink()
    with pytest.raises(streamload.CheckpointFileError, match="checkpoint file is missing") as err:
        streamload.load_checkpoint(_model(), d)
    assert err.value.file == str(d / victim)
    assert "named by the index entry for" in err.value.reason
    assert "download is incomplete" in _hint(err) and "hf download REPO --local-dir DIR" in _hint(err)


def test_missing_config_says_load_checkpoint(base: Path, tmp_path: Path) -> None:
    d = _copy(base, tmp_path, "no_config")
    (d / "config.json").unlink()
    with pytest.raises(streamload.CheckpointError, match="no config.json") as err:
        streamload.from_pretrained(d)
    assert err.value.file == str(d)
    assert "streamload.load_checkpoint(model, DIR)" in _hint(err)


# -- the model against the checkpoint -------------------------------------------


def test_shape_mismatch_says_build_from_config(base: Path) -> None:
    with pytest.raises(streamload.ShapeMismatchError, match=r"checkpoint shape \[\d+, \d+\] != model") as err:
        streamload.load_checkpoint(_model(intermediate_size=40), base)
    assert err.value.tensor is not None and "mlp" in err.value.tensor
    assert err.value.file is not None and err.value.file.startswith(str(base))
    assert f"config.json (AutoConfig.from_pretrained('{base}')" in _hint(err)


def test_dtype_mismatch_names_the_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "ints.safetensors"
    save_file({"w": torch.zeros(4, dtype=torch.int32)}, str(path))
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(streamload.DTypeMismatchError, match="I32 cannot be cast to the model's F32") as err:
        streamload.load_checkpoint(model, path)
    assert err.value.tensor == "w" and err.value.file == str(path)
    assert "casts only between floating dtypes" in _hint(err)
    assert "give 'w' the checkpoint's dtype I32" in _hint(err)


def test_missing_keys_say_strict_false(base: Path) -> None:
    with pytest.raises(streamload.KeyMismatchError, match="12 missing keys") as err:
        streamload.load_checkpoint(_model(layers=3), base)
    assert len(err.value.missing) == 12 and not err.value.unexpected
    assert "'model.layers.2." in err.value.reason and "and 7 more" in err.value.reason
    assert "unexpected" not in err.value.reason
    assert _hint(err).startswith("pass strict=False to load the rest")
    report = streamload.load_checkpoint(_model(layers=3), base, strict=False)  # the advice works
    assert sorted(report.missing_keys) == sorted(err.value.missing)


def test_unexpected_keys_say_ignore(base: Path) -> None:
    with pytest.raises(streamload.KeyMismatchError, match="12 unexpected keys") as err:
        streamload.load_checkpoint(_model(layers=1), base)
    assert all(k.startswith("model.layers.1.") for k in err.value.unexpected)
    assert "pass unexpected='ignore'" in _hint(err) and "pipeline stage" in _hint(err)
    streamload.load_checkpoint(_model(layers=1), base, unexpected="ignore")  # the advice works


def test_wrong_model_class_says_build_from_config(base: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    with pytest.raises(streamload.KeyMismatchError) as err:
        streamload.from_pretrained(base, model_cls=AutoModelForSequenceClassification)
    assert err.value.missing == ["score.weight"] and err.value.unexpected == ["lm_head.weight"]
    assert "'score.weight'" in err.value.reason and "'lm_head.weight'" in err.value.reason
    hint = _hint(err)
    assert "not this checkpoint's (architecture, class or config)" in hint
    assert f"AutoConfig.from_pretrained('{base}')" in hint and "strict=False" in hint


def test_other_architecture_lists_few_names(base: Path) -> None:
    from transformers import AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(make_config("gpt2", **SIZES))  # type: ignore[arg-type]
    with pytest.raises(streamload.KeyMismatchError) as err:
        streamload.load_checkpoint(gpt2, base)
    assert err.value.reason.count("'") == 20  # five names of each kind, not every key
    assert "architectures" in _hint(err)


def test_unknown_tensor_suggests_the_nearest(base: Path) -> None:
    with pytest.raises(streamload.TensorNotFoundError) as err:
        streamload.Checkpoint(base).read("model.norm.weights")
    assert err.value.tensor == "model.norm.weights"
    assert _hint(err) == "did you mean 'model.norm.weight'? Checkpoint.keys() lists every name"


# -- the hint crosses ranks -------------------------------------------------------


def test_hint_survives_pickling() -> None:
    err = streamload.CheckpointFileError(
        "checkpoint file is missing", "/c/m.safetensors", hint="fetch it", rank=2
    )
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is streamload.CheckpointFileError
    assert (back.hint, back.rank, str(back)) == ("fetch it", 2, str(err))
    keys = streamload.KeyMismatchError("1 missing keys", missing=["a"], unexpected=["b"], hint="strict=False")
    back = pickle.loads(pickle.dumps(keys))
    assert (back.missing, back.unexpected, back.hint) == (["a"], ["b"], "strict=False")
    assert str(streamload.StreamloadError("no hint")) == "no hint"


# -- the lean install (no [hf] extra) ----------------------------------------------


def test_from_pretrained_without_transformers_says_install_hf(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if never installed
    with pytest.raises(ImportError, match="needs transformers and accelerate") as err:
        streamload.from_pretrained(base)
    assert err.value.name == "accelerate"
    assert str(err.value).splitlines()[1] == "  hint: pip install 'streamload[hf]'"


def test_cli_without_transformers_says_install_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.tools.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["demo", "--ranks", "1", "--keep", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert "transformers" in err and "hint: pip install 'streamload[hf]'" in err
