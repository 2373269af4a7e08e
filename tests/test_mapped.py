"""Mapped shards: which boxes are one run of a file, and that a mapped
parameter reads the file's bytes, writes only private pages, and never
changes the file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from streamload import Checkpoint
from streamload.model.mapped import file_range, is_contiguous_box, map_shards
from streamload.plan.buckets import Target
from streamload.plan.regions import SourcePiece, identity_piece


@pytest.mark.parametrize(
    "start,extent,full,want",
    [
        ((0, 0), (4, 6), (4, 6), True),  # all of it
        ((1, 0), (2, 6), (4, 6), True),  # a row range
        ((1, 2), (1, 3), (4, 6), True),  # part of one row
        ((1, 2), (2, 3), (4, 6), False),  # a column block
        ((0, 0, 0), (1, 2, 5), (3, 4, 5), True),
        ((0, 1, 0), (2, 2, 5), (3, 4, 5), False),
        ((), (), (), True),  # a scalar
    ],
)
def test_contiguous_boxes(start, extent, full, want) -> None:
    assert is_contiguous_box(start, extent, full) is want


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "a": torch.randn(8, 6, generator=g).to(torch.bfloat16),
            "b": torch.randn(5, 3, generator=g),
            "c": torch.randn(6, 8, generator=g).to(torch.bfloat16),
        },
        str(tmp_path / "model.safetensors"),
    )
    return tmp_path


def test_file_range_only_for_one_run_in_the_same_dtype(ckpt: Path) -> None:
    c = Checkpoint(ckpt)
    info = c.info("a")
    plain = Target("a", (8, 6), (identity_piece("a", (8, 6)),))
    rows = ((2, 5), (0, 6))
    assert file_range(plain, rows, torch.bfloat16, c) == (info.file_index, info.offset + 2 * 6 * 2)
    assert file_range(plain, ((2, 5), (0, 3)), torch.bfloat16, c) is None  # a column block
    assert file_range(plain, rows, torch.float32, c) is None  # needs a cast
    # c transposed into an (8, 6) destination walks the source out of order: no run.
    transposed = Target("t", (8, 6), (SourcePiece("c", (0, 0), (8, 6), (0, 0), (1, 0)),))
    assert file_range(transposed, rows, torch.bfloat16, c) is None
    # Two pieces stacked: a box inside one piece is a run, across both it is not.
    stacked = Target(
        "s",
        (2, 8, 6),
        (
            SourcePiece("a", (0, 0, 0), (1, 8, 6), (0, 0), (None, 0, 1)),
            SourcePiece("a", (1, 0, 0), (1, 8, 6), (0, 0), (None, 0, 1)),
        ),
    )
    assert file_range(stacked, ((1, 2), (4, 8), (0, 6)), torch.bfloat16, c) == (
        info.file_index,
        info.offset + 4 * 6 * 2,
    )
    assert file_range(stacked, ((0, 2), (0, 8), (0, 6)), torch.bfloat16, c) is None


def test_mapped_parameters_are_copy_on_write(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    c = Checkpoint(ckpt)
    net = nn.Module()
    net.a = nn.Parameter(torch.empty(8, 6, dtype=torch.bfloat16))
    net.b = nn.Parameter(torch.empty(5, 3, dtype=torch.bfloat16))  # file is f32: copied, not mapped
    params = [net.a, net.b]
    targets = [
        Target(n, tuple(p.shape), (identity_piece(n, tuple(p.shape)),))
        for n, p in (("a", net.a), ("b", net.b))
    ]
    boxes = [tuple((0, s) for s in p.shape) for p in params]
    locals_ = [p.data for p in params]
    out = map_shards(targets, boxes, params, locals_, c, net)
    assert out.targets == {0} and out.nbytes == 8 * 6 * 2
    assert net.a.data_ptr() == locals_[0].data_ptr()
    assert net.b.data_ptr() == locals_[1].data_ptr()  # untouched: the load copies into it
    want = c.read("a")
    assert torch.equal(net.a.detach().view(torch.int16), want.view(torch.int16))
    with torch.no_grad():
        net.a.mul_(2)  # an optimizer step: private pages only
    assert torch.equal(net.a.detach(), (want * 2))
    del c
    assert hashlib.sha256(f.read_bytes()).hexdigest() == digest
    fresh = Checkpoint(ckpt).read("a")
    assert torch.equal(fresh.view(torch.int16), want.view(torch.int16))


def test_a_view_fsdp_does_not_take_is_given_back() -> None:
    """If FSDP's internals do not adopt the view, the shard stays as it was
    (and the load copies into it)."""
    from types import SimpleNamespace

    from streamload.model.mapped import _adopt

    original = torch.zeros(4, 3)
    view = torch.ones(4, 3)
    param = SimpleNamespace(_local_tensor=original)
    stubborn = SimpleNamespace(_sharded_param_data=original.view(-1), reset_sharded_param=lambda: None)
    assert _adopt(param, view, stubborn) is False
    assert param._local_tensor is original

    def adopt() -> None:
        willing._sharded_param_data = param._local_tensor.view(-1)

    willing = SimpleNamespace(_sharded_param_data=original.view(-1), reset_sharded_param=adopt)
    assert _adopt(param, view, willing) is True
    assert param._local_tensor is view and willing._sharded_param_data.data_ptr() == view.data_ptr()
