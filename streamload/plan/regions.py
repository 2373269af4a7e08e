"""Region algebra: a destination tensor as a tiling of source regions.

A destination parameter is described by pieces. Each piece places a box of
one checkpoint tensor at a position in the destination; ``dims`` says which
source dim feeds each destination dim (``None`` for a stacked size-1 dim), so
renames, stacking (MergeModulelist), concatenation, chunking and transposes
are all the same thing. For any destination box (one rank's shard) the
pieces it touches give the exact source regions to copy — no full fused
tensor and no full copy of a source ever exist.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

from ..errors import MappingError

Box = tuple[tuple[int, int], ...]  # [start, stop) per dim, global coordinates


@dataclass(frozen=True)
class SourcePiece:
    """One source region placed in the destination.

    Attributes:
        key: checkpoint tensor name.
        dst_start: where the piece starts in the destination tensor.
        shape: the piece's shape in destination dims.
        src_start: where the region starts in the source tensor (source dims).
        dims: for each destination dim, the source dim it walks (None: size 1).
    """

    key: str
    dst_start: tuple[int, ...]
    shape: tuple[int, ...]
    src_start: tuple[int, ...]
    dims: tuple[int | None, ...]

    @cached_property  # read per piece by every tiling check and region walk: built once
    def dst_box(self) -> Box:
        return tuple((s, s + n) for s, n in zip(self.dst_start, self.shape, strict=True))


def identity_piece(key: str, shape: Sequence[int]) -> SourcePiece:
    """The whole of ``key`` is the whole destination (a plain rename)."""
    n = len(shape)
    return SourcePiece(key, (0,) * n, tuple(int(s) for s in shape), (0,) * n, tuple(range(n)))


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= max(hi - lo, 0)
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None when it is empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) or (not out) else None


@dataclass(frozen=True)
class SourceRegion:
    """What to copy for one piece inside one destination box.

    Attributes:
        key: checkpoint tensor.
        shape: region shape in destination dim order.
        src_start: start of the region in the source tensor (source dims).
        dims: source dim per destination dim (None: a size-1 stacked dim).
        box_start: start of the region relative to the destination box.
    """

    key: str
    shape: tuple[int, ...]
    src_start: tuple[int, ...]
    dims: tuple[int | None, ...]
    box_start: tuple[int, ...]


def regions_for_box(pieces: Sequence[SourcePiece], box: Box) -> Iterator[SourceRegion]:
    """Yields the source regions that fill ``box`` of the destination."""
    for p in pieces:
        inter = intersect(p.dst_box, box)
        if inter is None:
            continue
        src_start = list(p.src_start)
        for d, s in enumerate(p.dims):
            if s is not None:
                src_start[s] += inter[d][0] - p.dst_start[d]
        yield SourceRegion(
            key=p.key,
            shape=tuple(hi - lo for lo, hi in inter),
            src_start=tuple(src_start),
            dims=p.dims,
            box_start=tuple(lo - b0 for (lo, _), (b0, _) in zip(inter, box, strict=True)),
        )


def find_overlap(pieces: Sequence[SourcePiece]) -> tuple[SourcePiece, SourcePiece, Box] | None:
    """Two pieces that place bytes in the same destination elements, and where; None if none do.

    A sweep along dim 0 compares each piece only with those whose dim-0 span is still
    open, so stacked experts (one row each) cost about one comparison per piece.
    """
    order = sorted((p for p in pieces if box_numel(p.dst_box) > 0), key=lambda p: p.dst_start)
    open_: list[SourcePiece] = []
    for p in order:
        lo = p.dst_start[0] if p.dst_start else 0
        open_ = [q for q in open_ if not q.dst_start or q.dst_start[0] + q.shape[0] > lo]
        for q in open_:
            both = intersect(q.dst_box, p.dst_box)
            if both is not None:
                return q, p, both
        open_.append(p)
    return None


def check_tiling(
    pieces: Sequence[SourcePiece], shape: Sequence[int], src_shapes: dict[str, tuple[int, ...]]
) -> str | None:
    """Returns why ``pieces`` do not tile ``shape`` exactly, or None when they do.

    Raises:
        MappingError: two pieces cover the same destination elements. The piece
            written last would win there, and the element count could still add
            up, leaving a hole elsewhere that keeps ``to_empty``'s bytes.
    """
    full = tuple((0, int(s)) for s in shape)
    total = 0
    for p in pieces:
        if len(p.dims) != len(shape) or len(p.shape) != len(shape):
            return f"piece from '{p.key}' has {len(p.shape)} dims, destination has {len(shape)}"
        if intersect(p.dst_box, full) != p.dst_box and box_numel(p.dst_box) > 0:
            return f"piece from '{p.key}' lies outside the destination {list(shape)}"
        src = src_shapes[p.key]
        for d, s in enumerate(p.dims):
            if s is None:
                if p.shape[d] != 1:
                    return f"stacked dim {d} of piece '{p.key}' must have size 1"
            elif not (0 <= p.src_start[s] and p.src_start[s] + p.shape[d] <= src[s]):
                return f"piece reads outside '{p.key}' {list(src)} along dim {s}"
        total += box_numel(p.dst_box)
    both = find_overlap(pieces)
    if both is not None:
        first, second, where = both
        raise MappingError(
            f"pieces from '{first.key}' and '{second.key}' both fill destination box "
            f"{[list(r) for r in where]} of {list(shape)}: a conversion's pieces must not overlap",
            tensor=first.key,
        )
    want = box_numel(full)
    if total != want:
        return f"sources cover {total} of {want} elements"
    return None
