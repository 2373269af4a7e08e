"""Layouts: where one rank holds a DTensor, as disjoint boxes of the global tensor, by torch's placement semantics.

A rank's shard of a DTensor is, along each tensor dim, a list of runs of
global indices in local order. ``Shard`` keeps one contiguous chunk of the
current local extent (``torch.chunk`` semantics, uneven and empty chunks
included); ``_StridedShard(split_factor=k)`` first splits the current extent
into ``k`` chunks, then takes chunk ``i`` of each of them and concatenates
them, so a rank's shard can be several disjoint boxes. Placements are applied
in mesh order, as ``distribute_tensor`` applies them (the default shard order
torch derives for these placements). The product of the per-dim runs gives
the boxes. Everything here is a pure function of (global shape, mesh shape,
placements, mesh coordinate): no process group is needed, so any rank can
derive any other rank's boxes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import product
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import PlacementError
from ..plan.regions import Box

Part = tuple[Box, tuple[int, ...]]  # (global box, its start inside the rank's local shard)
Run = tuple[int, int]  # (global start, length) along one dim


def check_placements(name: str, placements: Sequence[Any], ndim: int) -> None:
    """Raises PlacementError unless streamload can fill every placement exactly.

    Shard, _StridedShard and Replicate are filled; Partial (whose local
    values are summands, not a slice of the checkpoint) and any placement type
    torch may add later are refused by name.

    Args:
        name: the parameter, for the message.
        placements: the DTensor's placements, one per mesh dim.
        ndim: the tensor's number of dims (a shard dim must be inside it).

    Example:
        >>> check_placements("lm_head.weight", (Shard(0), Replicate()), 2)
    """
    for p in placements:
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Shard | _StridedShard):
            if not -ndim <= p.dim < ndim:
                raise PlacementError(
                    f"placements {tuple(placements)} shard dim {p.dim} of a {ndim}-d tensor", tensor=name
                )
            continue
        kind = (
            "Partial (pending reduction)"
            if isinstance(p, Partial)
            else f"unknown placement type {type(p).__name__}"
        )
        raise PlacementError(
            f"placements {tuple(placements)} cannot be filled exactly: {kind}; "
            "load into Shard/_StridedShard/Replicate placements and redistribute afterwards",
            tensor=name,
        )


def _chunk(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(length, offset) of chunk ``index`` of ``size`` under ``torch.chunk`` semantics."""
    length, offset = Shard.local_shard_size_and_offset(size, num_chunks, index)
    return int(length), int(offset)


def _pick(placement: Shard | _StridedShard, size: int, num_chunks: int, index: int) -> list[Run]:
    """The local ranges (offset, length) of ``size`` that ``index`` keeps, in local order."""
    if isinstance(placement, _StridedShard):
        out: list[Run] = []
        for j in range(int(placement.split_factor)):
            first_len, first_off = _chunk(size, int(placement.split_factor), j)
            length, offset = _chunk(first_len, num_chunks, index)
            if length:
                out.append((first_off + offset, length))
        return out
    length, offset = _chunk(size, num_chunks, index)
    return [(offset, length)] if length else []


def _compose(runs: Sequence[Run], ranges: Sequence[Run]) -> tuple[Run, ...]:
    """Maps local ``ranges`` through ``runs`` (local order -> global), merging neighbours."""
    out: list[Run] = []
    for lo, length in ranges:
        hi = lo + length
        pos = 0
        for g, n in runs:
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                start = g + a - pos
                if out and out[-1][0] + out[-1][1] == start:
                    out[-1] = (out[-1][0], out[-1][1] + b - a)
                else:
                    out.append((start, b - a))
            pos += n
            if pos >= hi:
                break
    return tuple(out)


@lru_cache(maxsize=65536)
def dim_runs(size: int, chain: tuple[tuple[Shard | _StridedShard, int, int], ...]) -> tuple[Run, ...]:
    """Global runs (start, length), in local order, that one dim of ``size`` keeps.

    Args:
        size: the global size of the dim.
        chain: (placement, mesh dim size, coordinate) for each mesh dim that
            shards this tensor dim, in mesh order.

    Returns:
        The runs; empty when this rank holds nothing along the dim.

    Example:
        >>> dim_runs(8, ((_StridedShard(0, split_factor=2), 2, 0),))
        ((0, 2), (4, 2))
    """
    runs: tuple[Run, ...] = ((0, size),) if size else ()
    for placement, num_chunks, index in chain:
        runs = _compose(runs, _pick(placement, sum(n for _, n in runs), num_chunks, index))
    return runs


def local_parts(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any], coord: Sequence[int] | None
) -> tuple[Part, ...]:
    """The disjoint boxes one mesh coordinate holds of a tensor, with their local starts.

    Args:
        shape: the global shape.
        mesh_shape: the device mesh's shape.
        placements: one per mesh dim (checked with ``check_placements`` first).
        coord: the rank's mesh coordinate, or None when it is not in the mesh.

    Returns:
        (box, local start) pairs in row-major local order; empty when the
        rank holds no element.

    Example:
        >>> local_parts((8, 4), (2, 2), (Shard(0), _StridedShard(0, split_factor=2)), (0, 1))
        ((((1, 2), (0, 4)), (0, 0)), (((3, 4), (0, 4)), (1, 0)))
    """
    return local_layout(shape, mesh_shape, placements, coord)[0]


def local_layout(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any], coord: Sequence[int] | None
) -> tuple[tuple[Part, ...], tuple[int, ...]]:
    """``local_parts`` and the local shard's shape (which keeps unsharded sizes when it is empty).

    Args:
        shape, mesh_shape, placements, coord: as for ``local_parts``.

    Returns:
        (parts, local shape): the boxes with their local starts, and the shape
        torch's ``to_local()`` has on that coordinate.

    Example:
        >>> local_layout((1, 3), (2, 2), (Shard(0), Shard(0)), (1, 0))
        ((), (0, 3))
    """
    key = (
        tuple(int(n) for n in shape),
        tuple(int(n) for n in mesh_shape),
        tuple((type(p), p) for p in placements),  # the type too: a _StridedShard is a Shard
        None if coord is None else tuple(int(c) for c in coord),
    )
    return _local_layout(*key)


@lru_cache(maxsize=4096)  # a model's layers repeat a few shapes: one walk per shape
def _local_layout(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    typed: tuple[tuple[type, Any], ...],
    coord: tuple[int, ...] | None,
) -> tuple[tuple[Part, ...], tuple[int, ...]]:
    placements = [p for _, p in typed]
    ndim = len(shape)
    if coord is None:
        return (), (0,) * ndim
    per_dim: list[tuple[Run, ...]] = []
    for d in range(ndim):
        chain = tuple(
            (p, int(mesh_shape[i]), int(coord[i]))
            for i, p in enumerate(placements)
            if isinstance(p, Shard | _StridedShard) and p.dim % max(ndim, 1) == d
        )
        per_dim.append(dim_runs(int(shape[d]), chain))
    extent = tuple(sum(n for _, n in runs) for runs in per_dim)
    if any(n == 0 for n in extent):
        return (), extent
    starts: list[list[int]] = []
    for runs in per_dim:
        acc, local = 0, []
        for _, n in runs:
            local.append(acc)
            acc += n
        starts.append(local)
    parts: list[Part] = []
    for choice in product(*(range(len(r)) for r in per_dim)):
        box = tuple((per_dim[d][k][0], per_dim[d][k][0] + per_dim[d][k][1]) for d, k in enumerate(choice))
        parts.append((box, tuple(starts[d][k] for d, k in enumerate(choice))))
    return tuple(parts), extent


def nested_shard_mismatch(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Any],
    coord: Sequence[int],
    have: Sequence[int],
) -> str | None:
    """Why a local shard differs from its placements when FSDP2 shards a TP shard again, or None.

    FSDP2 over tensor parallelism shards each TP rank's chunk of a dim again over the FSDP
    mesh dim (nested ``torch.chunk``) and describes it as ``_StridedShard(d, split_factor=k)``
    on the FSDP dim plus ``Shard(d)`` on the later TP dim. torch's ``_StridedShard`` semantics
    place the rows as if dim ``d`` split into ``k`` equal chunks: the two agree whenever the
    size of ``d`` is divisible by ``k``, and can differ otherwise (GPT-2's vocabulary of 50257
    over tp=2, dp=4: the last FSDP rank holds 6280 and 6282 rows where the placements say 6281).

    Returns:
        The explanation (which dim, its size, the degrees, the rows this rank holds and the rows
        the placements give, and the fix), when the placements have that form; else None.
    """
    for i, p in enumerate(placements):
        if not isinstance(p, _StridedShard):
            continue
        d = p.dim % max(len(shape), 1)
        later = [
            j
            for j in range(i + 1, len(placements))
            if type(placements[j]) is Shard and placements[j].dim % len(shape) == d
        ]
        if not later:
            continue
        k, size = int(p.split_factor), int(shape[d])
        if size % k == 0 or int(mesh_shape[later[0]]) != k:
            continue  # FSDP2 splits by the TP degree: another factor is not its nesting
        _, want = local_layout(shape, mesh_shape, placements, coord)
        tp = int(mesh_shape[later[0]])
        return (
            f"FSDP2 shards the tensor-parallel shard again: dim {d} ({size}) is split over {tp} TP ranks "
            f"(mesh dim {later[0]}), then each TP chunk over {int(mesh_shape[i])} FSDP ranks (mesh dim {i}), "
            f"which placements {tuple(placements)} describe exactly whenever dim {d} is divisible by the "
            f"split factor {k}; {size} is not, and at mesh coordinate {tuple(coord)} the local shard is "
            f"{list(have)} where the placements give {list(want)}. Pad dim {d} to a multiple of {k} "
            f"(for a vocabulary: resize_token_embeddings(..., pad_to_multiple_of={k})) or shard it over one "
            "mesh dim only"
        )
    return None
