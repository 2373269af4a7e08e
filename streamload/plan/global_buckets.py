"""Rank-independent buckets: boundaries from each target's global wire bytes, segments for the served ranks only.

``build_plan`` closes a bucket when the segments of every rank together
fill it, so anyone who wants the boundaries must enumerate every rank. Here
the boundaries follow from what every rank knows without enumerating any:
each target's global shape, wire dtype and how many copies of each element
the ranks hold together (``GlobalLayout``). A target is cut into chunks
along its row-major order (``split_box`` over the global box, dim-0 row
ranges first), each chunk's wire bytes over every rank is bounded from the
layout alone, and chunks fill buckets in target order. A rank then computes
only the segments of the ranks it serves: a ``src`` receiver its own (cost
targets x its boxes), the reader every rank's (it serves them all). Within a
chunk a row's segments follow its boxes' order, so a receiver and the reader
derive the same offsets.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..io.copy_ops import ITEMSIZE
from .buckets import ALIGN, Bucket, Placement, Plan, Segment, Target, split_box, wire_dtype
from .regions import Box, box_numel, intersect

# Row index in the plan, target index -> that row's Placement of the target.
PlaceFn = Callable[[int, int], Placement]


@dataclass(frozen=True)
class GlobalLayout:
    """What every rank knows of one target's layout without enumerating the ranks.

    Attributes:
        dtype: the parameter's safetensors dtype (the same on every rank; the spec digest proves it).
        copies: how many ranks hold each element (the replication over the mesh times its
            sibling instances; every rank for a plain tensor).
        max_segments: an upper bound on the (rank, box) pairs that hold a part of the target:
            the ranks that can hold one times the boxes a rank can hold.
    """

    dtype: str
    copies: int
    max_segments: int


@dataclass(frozen=True)
class Chunk:
    """A global sub-box of one target that travels in one bucket, every holder's part of it at once.

    Attributes:
        target: index into the plan's targets.
        box: the sub-box, global coordinates.
        wire: its wire dtype.
        bound: an upper bound on its wire bytes over every rank, alignment included.
    """

    target: int
    box: Box
    wire: str
    bound: int


def _chunks_of(t_idx: int, target: Target, wire: str, layout: GlobalLayout, limit: int) -> list[Chunk]:
    """``target`` cut into chunks whose bound fits ``limit`` where one element over every rank does."""
    isz = ITEMSIZE[wire]
    full = tuple((0, s) for s in target.shape)
    pad_all = ALIGN * layout.max_segments
    if 2 * pad_all <= limit:
        # Every segment of a chunk may add ALIGN bytes of padding: reserve them all.
        boxes = split_box(full, isz * layout.copies, limit - pad_all)
    else:
        # Too many possible segments for that (tiny buckets): bound per element instead,
        # each segment holding at least one.
        boxes = split_box(full, (isz + ALIGN) * layout.copies, limit)
    out = []
    for box in boxes:
        n = box_numel(box)
        bound = n * isz * layout.copies + ALIGN * min(n * layout.copies, layout.max_segments)
        out.append(Chunk(t_idx, box, wire, bound))
    return out


def bucket_chunks(
    targets: Sequence[Target],
    source_dtypes: dict[str, str],
    layouts: Sequence[GlobalLayout],
    bucket_bytes: int,
) -> list[list[Chunk]]:
    """The buckets as lists of chunks: a pure function of the targets and their global layouts.

    Args:
        targets: destination tensors, in streaming order.
        source_dtypes: checkpoint key -> dtype name.
        layouts: each target's GlobalLayout, in the same order.
        bucket_bytes: capacity of one bucket, all ranks together.

    Returns:
        One list of chunks per bucket; every bucket's bound is at most ``bucket_bytes``
        unless one element held by every copy exceeds it alone.

    Example:
        >>> len(bucket_chunks(targets, dtypes, layouts, 256 << 20))  # the same on every rank
    """
    if bucket_bytes < 4 * ALIGN:
        raise ValueError("bucket_bytes is too small")
    buckets: list[list[Chunk]] = []
    cur: list[Chunk] = []
    used = 0
    for t_idx, (t, layout) in enumerate(zip(targets, layouts, strict=True)):
        if box_numel(tuple((0, s) for s in t.shape)) == 0 or layout.copies == 0:
            continue
        wire = wire_dtype([source_dtypes[p.key] for p in t.pieces], layout.dtype)
        for chunk in _chunks_of(t_idx, t, wire, layout, bucket_bytes):
            if cur and used + chunk.bound > bucket_bytes:
                buckets.append(cur)
                cur, used = [], 0
            cur.append(chunk)
            used += chunk.bound
    if cur:
        buckets.append(cur)
    return buckets


class _Holders:
    """The served rows' boxes of one target, swept along dim 0 as the chunks advance.

    Chunks come in row-major order, so their dim-0 ranges never move back: a
    box that ends before the current chunk starts is dropped for good, and a
    box is taken in once the chunks reach its first row. Each chunk then looks
    at the boxes that overlap its rows only.
    """

    def __init__(self, rows: Sequence[Placement]) -> None:
        # (dim-0 start, row, box index, box, local start), sorted by dim-0 start.
        held = [
            (box[0][0] if box else 0, row, k, box, start)
            for row, pl in enumerate(rows)
            for k, (box, start) in enumerate(pl.boxes)
        ]
        held.sort(key=lambda h: (h[0], h[1], h[2]))
        self._held = held
        self._starts = [h[0] for h in held]
        self._next = 0
        self._active: list[tuple[int, int, int, Box, tuple[int, ...]]] = []

    def hits(self, chunk: Box) -> list[tuple[int, int, Box, Box, tuple[int, ...]]]:
        """(row, box index, sub-box, box, local start) of every box meeting ``chunk``, by (row, box index)."""
        if chunk:
            lo, hi = chunk[0]
            end = bisect_left(self._starts, hi, lo=self._next)
            self._active.extend(self._held[self._next : end])
            self._next = end
            self._active = [h for h in self._active if h[3][0][1] > lo]
        else:  # a 0-d target: every holder holds its one element
            self._active, self._next = self._held, len(self._held)
        out = []
        for _, row, k, box, start in self._active:
            sub = intersect(box, chunk)
            if sub is not None:
                out.append((row, k, sub, box, start))
        out.sort(key=lambda h: (h[0], h[1]))
        return out


def build_served_plan(
    targets: Sequence[Target],
    source_dtypes: dict[str, str],
    layouts: Sequence[GlobalLayout],
    rows: int,
    place: PlaceFn,
    bucket_bytes: int,
) -> Plan:
    """The plan's buckets (the same on every rank) with the segments of the served rows only.

    Args:
        targets: destination tensors, in streaming order.
        source_dtypes: checkpoint key -> dtype name.
        layouts: each target's GlobalLayout.
        rows: how many rows the plan has (the ranks this rank serves).
        place: (row, target index) -> that row's Placement; called once per row and target,
            and never for a rank that is not served.
        bucket_bytes: capacity of one bucket, all ranks together.

    Returns:
        A Plan over ``rows`` rows; ``max_bucket_bytes`` is exact on a plan over every rank.

    Example:
        >>> plan = build_served_plan(targets, dtypes, layouts, 1, lambda r, t: mine[t], 64 << 20)
    """
    chunked = bucket_chunks(targets, source_dtypes, layouts, bucket_bytes)
    buckets = [Bucket([[] for _ in range(rows)], [0] * rows) for _ in chunked]
    rank_total = [0] * rows
    payload = 0
    holders: _Holders | None = None
    current = -1
    for bucket, chunks in zip(buckets, chunked, strict=True):
        for chunk in chunks:
            if chunk.target != current:
                # One target's placements at a time: memory stays rows x one target.
                current = chunk.target
                holders = _Holders([place(r, current) for r in range(rows)])
            assert holders is not None
            isz = ITEMSIZE[chunk.wire]
            for row, _, sub, box, start in holders.hits(chunk.box):
                nbytes = box_numel(sub) * isz
                local_start = tuple(ls + s0 - b0 for ls, (s0, _), (b0, _) in zip(start, sub, box, strict=True))
                bucket.segments[row].append(
                    Segment(chunk.target, row, sub, local_start, chunk.wire, bucket.rank_bytes[row], nbytes)
                )
                padded = (nbytes + ALIGN - 1) // ALIGN * ALIGN
                bucket.rank_bytes[row] += padded
                rank_total[row] += padded
                payload += nbytes
    return Plan(list(targets), buckets, bucket_bytes, rows, payload, rank_total)
