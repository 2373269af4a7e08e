"""save_pretrained's progress bar: a tqdm bar of the bytes rank 0 writes, off by default when
stderr is not a TTY (as under CI), on with progress=True or STREAMLOAD_PROGRESS=1."""

from __future__ import annotations

import os

import pytest
import torch

import streamload


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8))


def _weights(d) -> int:
    return os.path.getsize(os.path.join(d, "model.safetensors"))


def test_bar_when_asked(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = streamload.save_pretrained(_model(), tmp_path / "o", progress=True, bucket_bytes=4096)
    err = capsys.readouterr().err
    assert "streamload save (owners)" in err and "100%" in err, err
    tensor_bytes = sum(p.numel() * 4 for p in _model().parameters())
    assert rep.bytes_written == _weights(tmp_path / "o")  # headers included in the report ...
    assert f"{tensor_bytes / 1000:.1f}k" in err, err  # ... the bar counts the tensor bytes written


def test_no_bar_by_default_off_a_tty(tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.delenv("STREAMLOAD_PROGRESS", raising=False)
    assert not os.isatty(2) or pytest.skip("stderr is a TTY here")
    streamload.save_pretrained(_model(), tmp_path / "o")
    assert "streamload save" not in capsys.readouterr().err


def test_environment_override(tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv("STREAMLOAD_PROGRESS", "1")
    streamload.save_pretrained(_model(), tmp_path / "a")
    assert "streamload save" in capsys.readouterr().err
    streamload.save_pretrained(_model(), tmp_path / "b", progress=False)  # the keyword wins
    assert "streamload save" not in capsys.readouterr().err
