"""Rank-independent buckets: boundaries from each target's global wire bytes, segments for the served ranks only.

``build_plan`` closes a bucket when the segments of every rank together
fill it, so anyone who wants the boundaries must enumerate every rank. Here
the boundaries follow from what every rank knows without enumerating any:
each target's global shape, wire dtype and how many copies of each element
the ranks hold together (``GlobalLayout``). A target is cut into chunks in
row-major order as ``split_box`` cuts a box, each chunk's wire bytes over
every rank is bounded from the layout alone, and chunks fill buckets in
target order. A rank then computes only the segments of the ranks it serves:
a ``src`` receiver its own, the reader every rank's (it serves them all).
The chunks of a target are equal ranges, so their buckets are arithmetic and
a receiver visits only the chunks its boxes meet: its cost is its segments,
one step per prefix row of a cut target and one list slot per bucket,
whatever the world size. A row's segments follow (chunk, box index) order,
so a receiver and the reader derive the same offsets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product

from ..io.copy_ops import ITEMSIZE
from .buckets import ALIGN, Bucket, Placement, Plan, Segment, Target, wire_dtype
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


class _Filler:
    """Bucket boundaries: chunks in order go to the current bucket while their bounds fit."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.index = 0  # the current bucket
        self.used = 0  # bound bytes in it (0: it is empty)

    def add(self, bound: int) -> int:
        """One chunk; returns its bucket."""
        if self.used and self.used + bound > self.capacity:
            self.index, self.used = self.index + 1, 0
        self.used += bound
        return self.index

    def add_run(self, count: int, bound: int) -> Callable[[int], int]:
        """``count`` chunks of one ``bound`` at once, as ``add`` would place them; returns chunk -> bucket."""
        start, used = self.index, self.used
        per = max(1, self.capacity // bound)  # what an empty bucket takes (at least one chunk)
        first = max(0, (self.capacity - used) // bound) if used else per
        last = count - 1
        if last < first:
            self.used = used + count * bound
        else:
            j = last - first
            self.index, self.used = start + 1 + j // per, (j % per + 1) * bound

        def bucket_of(k: int) -> int:
            return start if k < first else start + 1 + (k - first) // per

        return bucket_of

    @property
    def count(self) -> int:
        return self.index + 1 if self.used else self.index


class _Cut:
    """One target cut into chunks, and which bucket each chunk goes to.

    As ``split_box`` cuts: the outermost dim ``d`` whose slabs (one index of
    it, everything inside) fit is cut into ranges of ``step`` indices (the
    last shorter), the dims before it one index at a time. Chunk k is then
    (prefix p, range j) with k = p * ranges + j; the bucket of every range but
    the last of a prefix is arithmetic, so the cost is one step per prefix,
    not per chunk.
    """

    def __init__(self, shape: tuple[int, ...], wire: str, layout: GlobalLayout, filler: _Filler) -> None:
        isz = ITEMSIZE[wire]
        self.layout, self.isz, self.shape = layout, isz, shape
        limit = filler.capacity
        pad_all = ALIGN * layout.max_segments
        if 2 * pad_all <= limit:
            # Every segment of a chunk may add ALIGN bytes of padding: reserve them all.
            inner, limit = isz * layout.copies, limit - pad_all
        else:
            # Too many possible segments for that (tiny buckets): bound per element
            # instead, each segment holding at least one.
            inner = (isz + ALIGN) * layout.copies
        d, slab = len(shape) - 1, 1
        while d > 0 and inner * shape[d] <= limit:
            inner, slab, d = inner * shape[d], slab * shape[d], d - 1
        self.d = max(d, 0)
        size = shape[self.d] if shape else 1
        self.step = max(1, min(size, limit // inner))
        self.ranges = -(-size // self.step)
        self.prefixes = 1
        for n in shape[: self.d]:
            self.prefixes *= n
        full, tail = self.step * slab, (size - (self.ranges - 1) * self.step) * slab
        self._runs: list[Callable[[int], int]] = []
        self._lasts: list[int] = []
        for _ in range(self.prefixes):
            self._runs.append(filler.add_run(self.ranges - 1, self._bound(full)))
            self._lasts.append(filler.add(self._bound(tail)))

    def _bound(self, n: int) -> int:
        """Wire bytes of ``n`` elements over every copy, with the padding its segments can add."""
        return n * self.isz * self.layout.copies + ALIGN * min(
            n * self.layout.copies, self.layout.max_segments
        )

    def bucket(self, k: int) -> int:
        p, j = divmod(k, self.ranges)
        return self._lasts[p] if j == self.ranges - 1 else self._runs[p](j)

    def box(self, k: int) -> Box:
        if not self.shape:
            return ()
        p, j = divmod(k, self.ranges)
        prefix: list[tuple[int, int]] = []
        for n in reversed(self.shape[: self.d]):
            p, i = divmod(p, n)
            prefix.append((i, i + 1))
        lo = j * self.step
        rest = tuple((0, n) for n in self.shape[self.d + 1 :])
        return (*reversed(prefix), (lo, min(lo + self.step, self.shape[self.d])), *rest)

    def meeting(self, box: Box) -> list[int]:
        """The chunks that can meet ``box`` (those whose prefix and range overlap its own)."""
        if not box:
            return list(range(self.ranges * self.prefixes))
        lo, hi = box[self.d]
        js = range(lo // self.step, (hi - 1) // self.step + 1)
        out: list[int] = []
        for idx in product(*(range(a, b) for a, b in box[: self.d])):
            p = 0
            for i, n in zip(idx, self.shape[: self.d], strict=True):
                p = p * n + i
            out.extend(p * self.ranges + j for j in js)
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
        place: (row, target index) -> that row's Placement; called once per row and target
            that has elements, and never for a rank that is not served.
        bucket_bytes: capacity of one bucket, all ranks together.

    Returns:
        A Plan over ``rows`` rows. Every bucket's wire total is at most ``bucket_bytes``
        unless one element over every copy exceeds it alone; ``max_bucket_bytes`` is exact
        on a plan over every rank. Buckets without a segment of the served rows are one
        shared empty Bucket (a receiver of thousands of ranks holds one slot per bucket).

    Example:
        >>> plan = build_served_plan(targets, dtypes, layouts, 1, lambda r, t: mine[t], 64 << 20)
    """
    if bucket_bytes < 4 * ALIGN:
        raise ValueError("bucket_bytes is too small")
    filler = _Filler(bucket_bytes)
    made: dict[int, Bucket] = {}
    rank_total = [0] * rows
    payload = 0
    for t_idx, (t, layout) in enumerate(zip(targets, layouts, strict=True)):
        if box_numel(tuple((0, s) for s in t.shape)) == 0 or layout.copies == 0:
            continue
        wire = wire_dtype([source_dtypes[p.key] for p in t.pieces], layout.dtype)
        cut = _Cut(t.shape, wire, layout, filler)
        hits = []
        for row in range(rows):
            for k, (box, start) in enumerate(place(row, t_idx).boxes):
                for c in cut.meeting(box):
                    sub = intersect(box, cut.box(c))
                    if sub is not None:
                        hits.append((c, row, k, sub, box, start))
        # (chunk, row, box index) order: the same whichever rows a rank plans for.
        hits.sort(key=lambda h: (h[0], h[1], h[2]))
        isz = ITEMSIZE[wire]
        for c, row, _, sub, box, start in hits:
            b = cut.bucket(c)
            bucket = made.get(b)
            if bucket is None:
                bucket = made[b] = Bucket([[] for _ in range(rows)], [0] * rows)
            nbytes = box_numel(sub) * isz
            local_start = tuple(ls + s0 - b0 for ls, (s0, _), (b0, _) in zip(start, sub, box, strict=True))
            bucket.segments[row].append(
                Segment(t_idx, row, sub, local_start, wire, bucket.rank_bytes[row], nbytes)
            )
            padded = (nbytes + ALIGN - 1) // ALIGN * ALIGN
            bucket.rank_bytes[row] += padded
            rank_total[row] += padded
            payload += nbytes
    empty = Bucket([[] for _ in range(rows)], [0] * rows)
    buckets = [made.get(i, empty) for i in range(filler.count)]
    return Plan(list(targets), buckets, bucket_bytes, rows, payload, rank_total)
