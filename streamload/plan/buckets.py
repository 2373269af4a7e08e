"""Plan: which bytes go to which rank, bucket by bucket.

Pure functions of (targets, every rank's local boxes and dtypes, bucket
size): every rank computes the same plan, so no rank ever needs to be told
where its bytes land.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..errors import DTypeMismatchError, ShapeMismatchError, rebuild_hint
from ..io.copy_ops import ITEMSIZE, can_convert
from .regions import Box, SourcePiece, box_numel, check_tiling

ALIGN = 8  # every segment starts 8-byte aligned so it can be viewed as any dtype


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Target:
    """One destination tensor to fill (a canonical parameter or a persistent buffer).

    Attributes:
        name: fully qualified name in the model.
        shape: global shape.
        pieces: how checkpoint tensors tile it.
    """

    name: str
    shape: tuple[int, ...]
    pieces: tuple[SourcePiece, ...]


@dataclass(frozen=True)
class Placement:
    """Where one rank holds one target: its box in global coordinates and its dtype.

    A shard that is several disjoint boxes of the target (``_StridedShard``
    layouts) lists them in ``parts`` as (box, start inside the local shard);
    ``box`` is then empty, so nothing that expects one box (mapped shards)
    takes it for one.
    """

    box: Box
    dtype: str  # safetensors dtype name of the rank's parameter
    parts: tuple[tuple[Box, tuple[int, ...]], ...] = ()

    @property
    def boxes(self) -> tuple[tuple[Box, tuple[int, ...]], ...]:
        """Every (box, local start) this rank holds; none when it holds nothing."""
        if self.parts:
            return self.parts
        return ((self.box, (0,) * len(self.box)),) if box_numel(self.box) else ()


@dataclass(frozen=True)
class Segment:
    """A sub-box of one rank's shard of one target, as it travels in a bucket.

    Attributes:
        target: index into Plan.targets.
        rank: the owning rank.
        box: the sub-box, global coordinates.
        local_start: the sub-box's start inside the rank's local shard.
        wire_dtype: dtype on the wire (see ``wire_dtype``).
        offset: byte offset inside the rank's part of the bucket.
        nbytes: bytes on the wire.
    """

    target: int
    rank: int
    box: Box
    local_start: tuple[int, ...]
    wire_dtype: str
    offset: int
    nbytes: int


@dataclass
class Bucket:
    """One collective's worth: per rank, its segments and byte count.

    ``direct_rank`` is the rank (the reader, on CPU) whose segments are
    copied from the files straight into its shards: they never touch the
    staging ring or the wire.
    """

    segments: list[list[Segment]]
    rank_bytes: list[int]
    direct_rank: int | None = None

    @property
    def total_bytes(self) -> int:
        return sum(self.rank_bytes)

    def wire_bytes(self, rank: int) -> int:
        """Bytes ``rank`` receives through the transport for this bucket."""
        return 0 if rank == self.direct_rank else self.rank_bytes[rank]

    @property
    def wire_total(self) -> int:
        return sum(self.wire_bytes(r) for r in range(len(self.rank_bytes)))

    def wire_base(self, rank: int) -> int:
        """Byte offset of ``rank``'s part in the packed (sender) buffer."""
        return sum(self.wire_bytes(r) for r in range(rank))


@dataclass
class Plan:
    targets: list[Target]
    buckets: list[Bucket]
    bucket_bytes: int
    world_size: int
    payload_bytes: int = 0  # bytes on the wire, all ranks
    rank_bytes: list[int] = field(default_factory=list)  # bytes each rank receives in total

    def max_rank_bucket_bytes(self, rank: int) -> int:
        return max((b.wire_bytes(rank) for b in self.buckets), default=0)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.wire_total for b in self.buckets), default=0)

    def set_direct(self, rank: int | None) -> None:
        """Marks ``rank``'s segments as filled in place (see Bucket)."""
        for b in self.buckets:
            b.direct_rank = rank


# The one cast a receiver makes (transport/unpack.py): bf16 -> f32 is a 16-bit shift of
# the bits on every CPU and device, NaN payloads included. Every other cast runs on the
# sender's native engine, whose bits are torch's CPU cast (a GPU's conversion instructions
# write other NaNs: an sm_80+ f32 -> bf16 gives 0x7FFF where torch's CPU gives 0xFFFF).
RECEIVER_CASTS = frozenset({("BF16", "F32")})


def split_direct(bucket: Bucket, row: int, direct: frozenset[int]) -> tuple[Bucket | None, Bucket]:
    """``row``'s segments of ``bucket`` as two buckets of that row alone: those of the
    ``direct`` targets, filled in place (their ``direct_rank`` is ``row``; None when there
    are none), and the others, laid out afresh from offset 0 (what is staged; maybe empty).

    Example:
        >>> in_place, staged = split_direct(bucket, row, frozenset({0, 3}))
    """
    world = len(bucket.segments)

    def of(segments: list[Segment], direct_rank: int | None) -> Bucket:
        out = Bucket([[] for _ in range(world)], [0] * world, direct_rank)
        for seg in segments:
            out.segments[row].append(replace(seg, offset=out.rank_bytes[row]))
            out.rank_bytes[row] += _align(seg.nbytes)
        return out

    mine = bucket.segments[row]
    in_place = [seg for seg in mine if seg.target in direct]
    staged = of([seg for seg in mine if seg.target not in direct], None)
    return (of(in_place, row) if in_place else None), staged


def wire_dtype(source_dtypes: Sequence[str], dst: str) -> str:
    """The dtype on the wire: the parameter's, or bf16 where a bf16 file fills an f32
    parameter (half the bytes; the receiver widens it exactly, see ``RECEIVER_CASTS``)."""
    srcs = set(source_dtypes)
    if len(srcs) == 1:
        (src,) = srcs
        return src if (src, dst) in RECEIVER_CASTS else dst
    return dst


def split_box(box: Box, itemsize: int, limit: int) -> list[Box]:
    """Splits ``box`` into row-major sub-boxes of at most ``limit`` bytes."""
    if box_numel(box) * itemsize <= limit or not box:
        return [box]
    sizes = [hi - lo for lo, hi in box]
    inner = itemsize
    # Find the outermost dim whose rows (everything inside it) still fit.
    d = len(box) - 1
    while d > 0 and inner * sizes[d] <= limit:
        inner *= sizes[d]
        d -= 1
    # Now one index of dim d holds `inner` bytes, which fits; dims < d go one at a time.
    step = max(1, limit // inner)
    out: list[Box] = []

    def rec(prefix: list[tuple[int, int]], k: int) -> None:
        if k == d:
            lo, hi = box[d]
            for s in range(lo, hi, step):
                out.append((*prefix, (s, min(s + step, hi)), *box[d + 1 :]))
            return
        lo, hi = box[k]
        for i in range(lo, hi):
            rec([*prefix, (i, i + 1)], k + 1)

    rec([], 0)
    return out


def validate_shapes(targets: Sequence[Target], table: dict[str, tuple[str, tuple[int, ...], str]]) -> None:
    """Checks that the checkpoint tiles every target exactly, before any
    allocation; raises ShapeMismatchError naming the tensor and file.

    Args:
        targets: the plan's targets.
        table: checkpoint key -> (dtype, shape, file).
    """
    src_shapes = {k: v[1] for k, v in table.items()}
    for t in targets:
        first = t.pieces[0].key if t.pieces else None
        file = table[first][2] if first else None
        if len(t.pieces) == 1 and t.pieces[0].dims == tuple(range(len(t.shape))):
            src_shape = table[t.pieces[0].key][1]
            # A whole source tensor (not one a Split or Chunk narrowed) must be the target's shape.
            whole = tuple(t.pieces[0].shape) == tuple(src_shape)
            if whole and tuple(src_shape) != tuple(t.shape):
                raise ShapeMismatchError(
                    f"checkpoint shape {list(src_shape)} != model shape {list(t.shape)} for '{t.name}'",
                    file,
                    first,
                    hint=rebuild_hint(file),
                )
        why = check_tiling(t.pieces, t.shape, src_shapes)
        if why is not None:
            raise ShapeMismatchError(
                f"cannot build '{t.name}' {list(t.shape)}: {why}", file, first, hint=rebuild_hint(file)
            )


def validate_dtypes(
    targets: Sequence[Target],
    table: dict[str, tuple[str, tuple[int, ...], str]],
    placements: Sequence[Sequence[Placement]],
) -> None:
    """Checks that every source can be cast to every rank's parameter dtype;
    raises DTypeMismatchError naming the tensor and file.

    Args:
        targets: the plan's targets.
        table: checkpoint key -> (dtype, shape, file).
        placements: placements[rank][target].
    """
    for t_idx, t in enumerate(targets):
        for per_rank in placements:
            dst = per_rank[t_idx].dtype
            for p in t.pieces:
                if not can_convert(table[p.key][0], dst):
                    raise DTypeMismatchError(
                        f"checkpoint dtype {table[p.key][0]} cannot be cast to the model's {dst} for '{t.name}'",
                        table[p.key][2],
                        p.key,
                        hint=f"streamload casts only between floating dtypes (and widens fp8): give '{t.name}' "
                        f"the checkpoint's dtype {table[p.key][0]}, or {rebuild_hint(table[p.key][2])}",
                    )


def build_plan(
    targets: Sequence[Target],
    source_dtypes: dict[str, str],
    placements: Sequence[Sequence[Placement]],
    bucket_bytes: int,
) -> Plan:
    """Assigns every rank's shard of every target to buckets.

    Args:
        targets: destination tensors, in streaming order.
        source_dtypes: checkpoint key -> dtype name.
        placements: placements[rank][target] (every rank's box and dtype).
        bucket_bytes: capacity of one bucket, all ranks together.

    Returns:
        The plan; every bucket's total is at most ``bucket_bytes``.
    """
    if bucket_bytes < 4 * ALIGN:
        raise ValueError("bucket_bytes is too small")
    world = len(placements)
    limit = bucket_bytes - ALIGN
    buckets: list[Bucket] = []
    cur = Bucket([[] for _ in range(world)], [0] * world)
    rank_total = [0] * world
    payload = 0
    for t_idx, t in enumerate(targets):
        for rank in range(world):
            pl = placements[rank][t_idx]
            parts = pl.boxes
            if not parts:
                continue
            wire = wire_dtype([source_dtypes[p.key] for p in t.pieces], pl.dtype)
            isz = ITEMSIZE[wire]
            for part, part_start, sub in ((b, s, sub) for b, s in parts for sub in split_box(b, isz, limit)):
                nbytes = box_numel(sub) * isz
                padded = _align(nbytes)
                if cur.total_bytes + padded > bucket_bytes:
                    buckets.append(cur)
                    cur = Bucket([[] for _ in range(world)], [0] * world)
                local_start = tuple(
                    ls + s0 - b0 for ls, (s0, _), (b0, _) in zip(part_start, sub, part, strict=True)
                )
                cur.segments[rank].append(
                    Segment(t_idx, rank, sub, local_start, wire, cur.rank_bytes[rank], nbytes)
                )
                cur.rank_bytes[rank] += padded
                rank_total[rank] += padded
                payload += nbytes
    if cur.total_bytes:
        buckets.append(cur)
    return Plan(list(targets), buckets, bucket_bytes, world, payload, rank_total)
