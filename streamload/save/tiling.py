"""Exact tiling: before any byte is written, the ranks prove that every byte of the output
files is written by exactly one rank, from one value.

Each rank plans alone (``plan_save``, from its own model, ``dtype`` and ``max_shard_size``), so
the ranks compare what they planned:

- the same files: a rank that planned other headers would write at other offsets;
- no two ranks write overlapping regions of a hub tensor, unless the regions are the same box
  (below); a partial overlap means the ranks' meshes place shards differently;
- every element covered: a save group smaller than the model's mesh (a data-parallel group of
  a TP x FSDP model) would leave the other ranks' bytes as zeros;
- copies: one box planned by several ranks is one shard held on several disjoint meshes that
  DTensor does not call replicas (FSDP over ``mesh["dp"]`` of a TP x FSDP or EP x FSDP model
  keeps a norm or an attention weight once per TP / EP coordinate; two ranks each with a
  one-rank mesh hold the whole model twice). The ranks holding a copy compare a digest of its
  bytes: equal copies are written once (by the lowest group rank), copies that differ are a
  ``SaveError`` naming the tensor and the ranks - never a file mixing both.

Replicas that DTensor declares (a ``Replicate`` placement, e.g. HSDP's replicate dim) are not
compared: ``plan_save`` lets coordinate 0 write them and the others plan nothing.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist

from ..errors import SaveError
from ..io.copy_ops import ITEMSIZE
from ..plan.regions import Box, SourcePiece, box_numel, find_overlap
from ..transport.collectives import all_gather_object, solo
from .layout import Layout
from .plan import Piece, SavePlan, local_of

# A region of a hub tensor: (index of the hub tensor in ``sorted(layout.tensors)``, start, shape).
Region = tuple[int, tuple[int, ...], tuple[int, ...]]

_SUBGROUP_HINT = (
    "save over every rank that holds a shard of the model: process_group= the group the model"
    " is sharded over (for a TP x FSDP model, the whole mesh, not mesh['dp'])"
)


def check_tiling(
    layout: Layout, plan: SavePlan, group: dist.ProcessGroup | None, device: torch.device
) -> SavePlan:
    """Collective: checks that the ranks' plans tile the output exactly; returns this rank's
    plan with the copies another rank writes taken out.

    Args:
        layout: the output layout this rank planned.
        plan: this rank's ``plan_save``.
        group: the save's group (None: one process).
        device: where the agreement's objects travel.

    Returns:
        ``plan``, or a copy of it without the pieces a lower rank holding the same bytes writes.

    Raises:
        SaveError: on every rank, before any write: different files planned, two ranks
            writing overlapping regions, elements no rank writes, or copies that differ.

    Example:
        >>> plan = check_tiling(layout, plan_save(model, layout, rank), group, device)
    """
    keys = sorted(layout.tensors)
    index = {k: i for i, k in enumerate(keys)}
    mine = [(index[p.key], tuple(p.src_start), p.hub_shape()) for p in plan.pieces]
    single = solo(group)
    gathered = (
        [(_files_digest(layout), mine)]
        if single
        else all_gather_object((_files_digest(layout), mine), group, device)
    )
    digests = [g[0] for g in gathered]
    if len(set(digests)) > 1:
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        raise SaveError(
            f"the ranks planned different output files (group ranks {bad} differ from rank 0)",
            hint="call save_pretrained with the same dtype= and max_shard_size= on every rank of the save's group",
        )
    holders = _holders([g[1] for g in gathered])
    _refuse_overlaps(keys, holders, group)
    _refuse_gaps(layout, keys, holders)
    copies = {region: ranks for region, ranks in holders.items() if len(ranks) > 1}
    if not copies:
        return plan
    return _settle_copies(plan, layout, mine, copies, keys, group, device)


def _files_digest(layout: Layout) -> str:
    h = hashlib.sha1()
    for f in layout.files:
        h.update(f.name.encode() + b"\0" + f.size.to_bytes(8, "little") + f.header)
    h.update(layout.index or b"")
    return h.hexdigest()


def _holders(per_rank: Sequence[Sequence[Region]]) -> dict[Region, list[int]]:
    """Region -> the group ranks that planned exactly that region, in rank order."""
    out: dict[Region, list[int]] = {}
    for rank, regions in enumerate(per_rank):
        for region in regions:
            out.setdefault(region, []).append(rank)
    return out


def _box(region: Region) -> Box:
    _, start, shape = region
    return tuple((s, s + n) for s, n in zip(start, shape, strict=True))


def _refuse_overlaps(
    keys: list[str], holders: dict[Region, list[int]], group: dist.ProcessGroup | None
) -> None:
    """Raises when two different regions of one hub tensor overlap (the same region on several
    ranks is a copy, settled by ``_settle_copies``)."""
    by_key: dict[int, list[SourcePiece]] = {}
    for k, start, shape in holders:
        by_key.setdefault(k, []).append(SourcePiece(keys[k], start, shape, start, tuple(range(len(start)))))
    for k, pieces in by_key.items():
        if len(pieces) < 2:
            continue
        hit = find_overlap(pieces)
        if hit is None:
            continue
        a, b, both = hit
        ra = _global(holders[(k, a.dst_start, a.shape)], group)
        rb = _global(holders[(k, b.dst_start, b.shape)], group)
        raise SaveError(
            f"output tensor '{keys[k]}': ranks {ra} and {rb} both write elements {_fmt(both)} "
            f"(boxes {_fmt(a.dst_box)} and {_fmt(b.dst_box)}): the ranks' meshes place this tensor's "
            "shards differently, so no rank's bytes can be trusted there",
            tensor=keys[k],
            rank=ra[0],
            hint="shard the model over one device mesh that every rank of the save builds the same way",
        )


def _refuse_gaps(layout: Layout, keys: list[str], holders: dict[Region, list[int]]) -> None:
    """Raises when the ranks' regions (each copy counted once) leave elements unwritten."""
    covered = [0] * len(keys)
    for region in holders:
        covered[region[0]] += box_numel(_box(region))
    short = [i for i, k in enumerate(keys) if covered[i] != math.prod(layout.tensors[k].shape)]
    if not short:
        return
    need = sum(math.prod(t.shape) * ITEMSIZE[t.dtype] for t in layout.tensors.values())
    have = sum(covered[i] * ITEMSIZE[layout.tensors[k].dtype] for i, k in enumerate(keys))
    first = keys[short[0]]
    raise SaveError(
        f"the save's ranks hold {have} of the checkpoint's {need} bytes ({len(short)} output tensors "
        f"not covered, first '{first}': {covered[short[0]]} of {math.prod(layout.tensors[first].shape)} elements)",
        tensor=first,
        hint=_SUBGROUP_HINT,
    )


def _settle_copies(
    plan: SavePlan,
    layout: Layout,
    mine: list[Region],
    copies: dict[Region, list[int]],
    keys: list[str],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> SavePlan:
    """Collective: the ranks holding a copy compare a digest of its bytes; equal copies are
    written by their lowest rank, different ones raise on every rank."""
    rank = dist.get_rank(group) if group is not None else 0
    failed: Exception | None = None
    held: dict[Region, bytes] | tuple[int, str] = {}
    try:
        held = {
            region: _digest(piece, plan, layout)
            for region, piece in zip(mine, plan.pieces, strict=True)
            if region in copies
        }
    except Exception as exc:  # noqa: BLE001 - agreed below: the others are in the same gather
        failed = exc
        held = (_global([rank], group)[0], f"{type(exc).__name__}: {exc}")
    gathered = [held] if solo(group) else all_gather_object(held, group, device)
    errors = [g for g in gathered if isinstance(g, tuple)]
    if errors:
        who, what = errors[0]
        err = SaveError(f"comparing the copies' digests failed: {what}", rank=who)
        raise err from failed
    for region, ranks in sorted(copies.items()):
        values = {r: cast(dict, gathered[r])[region] for r in ranks}
        if len(set(values.values())) > 1:
            differ = [r for r in ranks if values[r] != values[ranks[0]]]
            key = keys[region[0]]
            raise SaveError(
                f"output tensor '{key}' {_fmt(_box(region))}: ranks {_global(ranks, group)} each hold this "
                f"region (copies of one shard on different meshes), and ranks {_global(differ, group)} hold "
                f"other values than rank {_global(ranks[:1], group)[0]}: refusing to write a mix of them",
                tensor=key,
                rank=_global(differ, group)[0],
                hint="the copies should be equal (a model sharded over mesh['dp'] of a larger mesh, or one mesh "
                "per rank): synchronise them, or save over one mesh's ranks (process_group=/device_mesh=)",
            )
    drop = {region for region, ranks in copies.items() if ranks[0] != rank}
    if not drop:
        return plan
    pieces: list[Piece] = [p for region, p in zip(mine, plan.pieces, strict=True) if region not in drop]
    return replace(plan, pieces=pieces)


def _digest(piece: Piece, plan: SavePlan, layout: Layout) -> bytes:
    """A digest of the bytes this rank would write for ``piece``: its values cast to the output
    dtype as the writer casts them (an fp8-quantized output: its own values, with their dtype),
    so copies held in different dtypes compare by what lands in the file."""
    region = piece.view(local_of(plan.tensors[piece.target]))
    out = layout.tensors[piece.key].torch_dtype
    if out.itemsize > 1 or not out.is_floating_point:
        region = region.to(out)
    region = region.contiguous().cpu()
    h = hashlib.blake2b(str(region.dtype).encode(), digest_size=16)
    data: Any = region.reshape(-1).view(torch.uint8).numpy()  # a buffer: hashed without a copy
    h.update(data)
    return h.digest()


def _global(ranks: Sequence[int], group: dist.ProcessGroup | None) -> list[int]:
    if group is None:
        return list(ranks)
    return [dist.get_global_rank(group, r) for r in ranks]


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"
