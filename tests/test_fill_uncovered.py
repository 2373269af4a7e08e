"""Tensors built on meta that the checkpoint lacks (strict=False): initialised by an initialiser
that really writes them, or a KeyMismatchError naming them — never to_empty's bytes. One process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import streamload


class Scaled(nn.Module):
    def __init__(self, writes: bool) -> None:
        super().__init__()
        self.writes = writes
        self.gain = nn.Parameter(torch.empty(5))

    def reset_parameters(self) -> None:
        if self.writes:
            nn.init.constant_(self.gain, 0.5)


class Model(nn.Module):
    def __init__(self, writes: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)  # in the file
        self.scaled = Scaled(writes)  # not in the file: its reset_parameters decides


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fill")
    g = torch.Generator().manual_seed(11)
    save_file(
        {"lin.weight": torch.randn(4, 3, generator=g), "lin.bias": torch.randn(4, generator=g)},
        str(root / "model.safetensors"),
    )
    return root


def _meta(writes: bool) -> nn.Module:
    with torch.device("meta"):
        return Model(writes)


def test_a_no_op_reset_parameters_is_loud(ckpt: Path) -> None:
    with pytest.raises(streamload.KeyMismatchError, match=r"no initialiser wrote them.*scaled\.gain"):
        streamload.load_checkpoint(_meta(False), ckpt, strict=False, progress=False)


def test_a_reset_parameters_that_writes_initialises(ckpt: Path) -> None:
    model = _meta(True)
    report = streamload.load_checkpoint(model, ckpt, strict=False, progress=False)
    assert report.missing_keys == ["scaled.gain"]
    assert torch.equal(model.scaled.gain.detach(), torch.full((5,), 0.5))
