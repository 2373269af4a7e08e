"""A conversion whose pieces overlap is refused at plan time (MappingError), even where
the element count adds up and so hides a hole that would keep ``to_empty``'s bytes."""

from __future__ import annotations

import pytest

from streamload.errors import MappingError
from streamload.plan.buckets import Target, validate_shapes
from streamload.plan.regions import SourcePiece, check_tiling, find_overlap, identity_piece


def _rows(key: str, start: int, rows: int, cols: int = 4) -> SourcePiece:
    """``rows`` rows of a [rows, cols] source placed at row ``start`` of the destination."""
    return SourcePiece(key, (start, 0), (rows, cols), (0, 0), (0, 1))


def test_overlap_with_a_hole_that_the_count_hides_is_a_mapping_error() -> None:
    # Destination [6, 4]: a covers rows 0-2, b rows 2-4 (row 2 twice), nothing covers row 5.
    pieces = [_rows("a", 0, 3), _rows("b", 2, 3)]
    assert sum(p.shape[0] for p in pieces) == 6  # the count alone adds up
    with pytest.raises(MappingError, match=r"'a' and 'b' both fill destination box \[\[2, 3\], \[0, 4\]\]"):
        check_tiling(pieces, (6, 4), {"a": (3, 4), "b": (3, 4)})
    table = {"a": ("F32", (3, 4), "f.safetensors"), "b": ("F32", (3, 4), "f.safetensors")}
    with pytest.raises(MappingError, match="must not overlap"):
        validate_shapes([Target("w", (6, 4), tuple(pieces))], table)


def test_fused_experts_tile_without_overlap_and_a_duplicated_expert_is_caught() -> None:
    # gate_up [E=4, 2I=4, H=2] = stack over experts of cat(gate, up).
    pieces = [
        SourcePiece(f"e{e}.{proj}", (e, 2 * j, 0), (1, 2, 2), (0, 0), (None, 0, 1))
        for e in range(4)
        for j, proj in enumerate(("gate", "up"))
    ]
    shapes = {p.key: (2, 2) for p in pieces}
    assert find_overlap(pieces) is None and check_tiling(pieces, (4, 4, 2), shapes) is None
    # Expert 3's up projection placed over expert 3's gate: same count, a hole where up belonged.
    moved = [*pieces[:-1], SourcePiece("e3.up", (3, 0, 0), (1, 2, 2), (0, 0), (None, 0, 1))]
    with pytest.raises(MappingError, match="'e3.gate' and 'e3.up'"):
        check_tiling(moved, (4, 4, 2), shapes)


def test_pieces_that_only_touch_do_not_overlap() -> None:
    # Column halves and a piece spanning every row after a taller one: edges touch, nothing overlaps.
    pieces = [
        SourcePiece("l", (0, 0), (4, 2), (0, 0), (0, 1)),
        SourcePiece("r", (0, 2), (4, 2), (0, 0), (0, 1)),
        _rows("tail", 4, 2),
    ]
    assert find_overlap(pieces) is None
    assert check_tiling(pieces, (6, 4), {"l": (4, 2), "r": (4, 2), "tail": (2, 4)}) is None
    # Two scalars into one scalar.
    assert find_overlap([identity_piece("x", ()), identity_piece("y", ())]) is not None
