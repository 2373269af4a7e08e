"""Planning logic with no processes: boxes, buckets, region algebra."""

from __future__ import annotations

import itertools
import os

import pytest

from streamload.errors import DTypeMismatchError, ShapeMismatchError
from streamload.plan.buckets import (
    ALIGN,
    Placement,
    Target,
    build_plan,
    split_box,
    validate_dtypes,
    validate_shapes,
    wire_dtype,
)
from streamload.plan.regions import SourcePiece, box_numel, check_tiling, identity_piece, regions_for_box
from streamload.report import progress_enabled


def _cells(box):
    return set(itertools.product(*[range(lo, hi) for lo, hi in box]))


@pytest.mark.parametrize(
    "box,itemsize,limit",
    [
        (((0, 10), (0, 7)), 2, 30),
        (((3, 9), (2, 5), (0, 4)), 4, 40),
        (((0, 1), (0, 100)), 2, 16),
        (((0, 5),), 8, 8),
        ((), 4, 64),
        (((0, 64), (0, 64)), 2, 1 << 20),
    ],
)
def test_split_box_tiles_within_limit(box, itemsize, limit) -> None:
    parts = split_box(box, itemsize, limit)
    assert all(box_numel(p) * itemsize <= max(limit, itemsize) for p in parts)
    cells = [c for p in parts for c in _cells(p)]
    assert len(cells) == len(set(cells)) and set(cells) == _cells(box)


def _shard0(shape, ws, r):
    rows = shape[0]
    chunk = -(-rows // ws)
    lo, hi = min(r * chunk, rows), min((r + 1) * chunk, rows)
    if hi <= lo:
        return tuple((0, 0) for _ in shape)
    return ((lo, hi), *[(0, s) for s in shape[1:]])


def test_build_plan_buckets_and_ownership() -> None:
    shapes = {"a": (10, 6), "b": (3,), "c": (1, 40), "d": ()}
    targets = [Target(k, s, (identity_piece(k, s),)) for k, s in shapes.items()]
    ws, bucket = 4, 128
    placements = [
        [Placement(_shard0(s, ws, r) if s else (), "F32") for s in shapes.values()] for r in range(ws)
    ]
    plan = build_plan(targets, {k: "BF16" for k in shapes}, placements, bucket)
    assert all(b.total_bytes <= bucket for b in plan.buckets)
    assert len(plan.buckets) > 1
    for t_idx, t in enumerate(targets):
        for r in range(ws):
            got = [c for b in plan.buckets for s in b.segments[r] if s.target == t_idx for c in _cells(s.box)]
            want = _cells(placements[r][t_idx].box) if box_numel(placements[r][t_idx].box) else set()
            assert len(got) == len(set(got)) and set(got) == want, (t.name, r)
    for b in plan.buckets:
        for segs in b.segments:
            assert all(s.offset % ALIGN == 0 and s.wire_dtype == "BF16" for s in segs)
    assert plan.payload_bytes == 2 * (60 + 3 + 40 + 1 * ws)


def test_wire_dtype_narrows_on_sender() -> None:
    assert wire_dtype(["BF16"], "F32") == "BF16"
    assert wire_dtype(["F32"], "BF16") == "BF16"
    assert wire_dtype(["F16", "BF16"], "F32") == "F32"


def test_regions_for_fused_experts() -> None:
    # gate_up [E=3, 2I=4, H=2] = stack over experts of cat(gate [2,2], up [2,2])
    pieces = []
    for e in range(3):
        for j, proj in enumerate(("gate", "up")):
            pieces.append(SourcePiece(f"e{e}.{proj}", (e, 2 * j, 0), (1, 2, 2), (0, 0), (None, 0, 1)))
    src_shapes = {p.key: (2, 2) for p in pieces}
    assert check_tiling(pieces, (3, 4, 2), src_shapes) is None
    regs = list(regions_for_box(pieces, ((1, 3), (1, 3), (0, 2))))
    assert {r.key for r in regs} == {"e1.gate", "e1.up", "e2.gate", "e2.up"}
    gate = next(r for r in regs if r.key == "e1.gate")
    assert gate.shape == (1, 1, 2) and gate.src_start == (1, 0) and gate.box_start == (0, 0, 0)
    assert check_tiling(pieces[:-1], (3, 4, 2), src_shapes) == "sources cover 20 of 24 elements"


def test_validate_targets_named_errors() -> None:
    t = Target("w", (4, 4), (identity_piece("w", (4, 5)),))
    with pytest.raises(ShapeMismatchError, match="checkpoint shape") as err:
        validate_shapes([t], {"w": ("F32", (4, 5), "f.safetensors")})
    assert err.value.file == "f.safetensors" and err.value.tensor == "w"
    t = Target("w", (4,), (identity_piece("w", (4,)),))
    with pytest.raises(DTypeMismatchError):
        validate_dtypes([t], {"w": ("I64", (4,), "f")}, [[Placement(((0, 4),), "F32")]])


def test_progress_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keyword when given; else STREAMLOAD_PROGRESS; else only on a TTY."""
    monkeypatch.setenv("STREAMLOAD_PROGRESS", "0")
    assert progress_enabled(None) is False
    assert progress_enabled(True) is True  # a keyword passed explicitly wins
    monkeypatch.setenv("STREAMLOAD_PROGRESS", "1")
    assert progress_enabled(None) is True
    assert progress_enabled(False) is False
    monkeypatch.delenv("STREAMLOAD_PROGRESS")
    assert progress_enabled(True) is True and progress_enabled(False) is False
    assert progress_enabled(None) is os.isatty(2)
    monkeypatch.setenv("STREAMLOAD_PROGRESS", "sometimes")
    with pytest.raises(ValueError, match="STREAMLOAD_PROGRESS"):
        progress_enabled(None)


def _materialize(sym, sources):
    """Fills a symbolic tensor from its pieces, the way the packer's copy ops do."""
    import torch

    out = torch.full(sym.shape, float("nan"))
    for r in regions_for_box(sym.pieces, tuple((0, s) for s in sym.shape)):
        src = sources[r.key]
        index = [slice(None)] * src.dim()
        order = []  # source dims in destination order (a transpose reorders them)
        for i, d in enumerate(r.dims):
            if d is not None:
                index[d] = slice(r.src_start[d], r.src_start[d] + r.shape[i])
                order.append(d)
        view = src[tuple(index)].permute(*order)
        out[tuple(slice(b, b + n) for b, n in zip(r.box_start, r.shape, strict=True))] = view.reshape(r.shape)
    return out


def test_symbolic_ops_equal_torch() -> None:
    """stack / cat / chunk / transpose on pieces equal torch's ops on the tensors."""
    import torch

    from streamload.plan.convert import Sym, _cat, _chunk, _stack, _transpose

    gen = torch.Generator().manual_seed(0)
    srcs = {f"e{e}.{p}": torch.randn(3, 4, generator=gen) for e in range(3) for p in ("g", "u")}

    def leaf(k):
        return Sym((3, 4), [identity_piece(k, (3, 4))])

    fused = _cat(
        [_stack([leaf(f"e{e}.g") for e in range(3)], 0), _stack([leaf(f"e{e}.u") for e in range(3)], 0)], 1
    )
    ref = torch.cat(
        [torch.stack([srcs[f"e{e}.g"] for e in range(3)]), torch.stack([srcs[f"e{e}.u"] for e in range(3)])],
        1,
    )
    assert torch.equal(_materialize(fused, srcs), ref)
    for part, want in zip(_chunk(fused, 1, 2), torch.chunk(ref, 2, 1), strict=True):
        assert torch.equal(_materialize(part, srcs), want)
    for part, want in zip(_chunk(fused, 2, 3), torch.chunk(ref, 3, 2), strict=True):  # uneven: 2+2 of 4
        assert torch.equal(_materialize(part, srcs), want)
    assert torch.equal(_materialize(_transpose(leaf("e0.g"), 0, 1), srcs), srcs["e0.g"].t())
