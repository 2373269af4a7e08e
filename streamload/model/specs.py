"""Layout specs: each target's global shape, dtype, mesh and placements, from which any rank's boxes follow.

Every rank holds the same model structure, so every rank has every
parameter's spec locally. A rank derives the placements of exactly the ranks
it plans for (itself; its node; every rank for the ``src`` reader) from the
specs, with the same pure function each rank uses for itself
(``layouts.local_layout``). Ranks prove they agree by all-gathering one short
digest of their specs, never the placements themselves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from ..io.copy_ops import ST_DTYPES
from ..plan.buckets import Placement
from ..plan.global_buckets import GlobalLayout
from .layouts import local_layout


@dataclass(frozen=True, eq=False)
class MeshInfo:
    """A device mesh as plain data: its shape and its global ranks in row-major order.

    Attributes:
        shape: the mesh shape.
        ranks: global rank at each mesh position, row-major, for every instance of
            the mesh one after the other (a submesh has one instance per
            coordinate of the dims it leaves out).
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    _coords: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """The mesh coordinate of global ``rank`` in its instance, or None when it is in none."""
        if not self._coords:
            for pos, r in enumerate(self.ranks):
                coord = []
                for n in reversed(self.shape):
                    coord.append(pos % n)
                    pos //= n
                self._coords[r] = tuple(reversed(coord))
        return self._coords.get(rank)


@dataclass(frozen=True)
class LayoutSpec:
    """One target as every rank sees it: enough to place it on any rank.

    Attributes:
        shape: global shape.
        dtype: safetensors dtype name of the parameter.
        mesh: its mesh, or None for a plain tensor (every rank holds all of it).
        placements: one per mesh dim.
    """

    shape: tuple[int, ...]
    dtype: str
    mesh: MeshInfo | None = None
    placements: tuple[Any, ...] = ()


def layout_specs(tensors: Sequence[torch.Tensor]) -> list[LayoutSpec]:
    """The spec of each tensor (DTensor or plain); meshes are converted once each.

    Args:
        tensors: the targets' tensors as the model holds them.

    Returns:
        One LayoutSpec per tensor; tensors on one mesh share its MeshInfo.

    Example:
        >>> specs = layout_specs([get_tensor(model, t.name) for t in targets])
    """
    meshes: dict[int, MeshInfo] = {}
    out: list[LayoutSpec] = []
    for t in tensors:
        dtype = ST_DTYPES[t.dtype]
        mesh = getattr(t, "device_mesh", None)
        if mesh is None or not hasattr(t, "placements"):
            out.append(LayoutSpec(tuple(int(s) for s in t.shape), dtype))
            continue
        info = meshes.get(id(mesh))
        if info is None:
            info = meshes[id(mesh)] = MeshInfo(tuple(int(s) for s in mesh.shape), sibling_ranks(mesh))
        out.append(LayoutSpec(tuple(int(s) for s in t.shape), dtype, info, tuple(t.placements)))
    return out


def sibling_ranks(mesh: Any) -> tuple[int, ...]:
    """Global ranks of every instance of ``mesh`` (all its sibling submeshes), row-major.

    ``mesh["dp"]`` on rank 1 of a (dp, tp) 2x2 mesh is [1, 3]; rank 0's is
    [0, 2]. A rank that plans for others needs every instance, which torch
    keeps as the submesh's layout over the root's rank map (private: if torch
    drops it, this rank's own instance is used, the ranks' digests then
    differ for submeshes and the load raises PlacementError; never a silent
    mis-placement — tests/test_parallel_dist.py exercises it).
    """
    layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    if layout is not None and rank_map is not None and hasattr(layout, "remap_to_tensor"):
        every = layout.remap_to_tensor(rank_map)
        return tuple(int(r) for r in every.flatten().tolist())
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def placement_for(spec: LayoutSpec, rank: int) -> Placement:
    """Where global ``rank`` holds the target of ``spec`` (see ``local_placement`` for its own).

    Args:
        spec: the target's layout spec.
        rank: a global rank.

    Returns:
        Its Placement: one box, several (``parts``), or none when it holds nothing.

    Example:
        >>> placement_for(spec, 8191).boxes
    """
    if spec.mesh is None:
        return Placement(tuple((0, s) for s in spec.shape), spec.dtype)
    parts, _ = local_layout(spec.shape, spec.mesh.shape, spec.placements, spec.mesh.coordinate(rank))
    if len(parts) == 1:
        return Placement(parts[0][0], spec.dtype)
    return Placement(tuple((0, 0) for _ in spec.shape), spec.dtype, parts)


def placements_for(specs: Sequence[LayoutSpec], ranks: Sequence[int]) -> list[list[Placement]]:
    """placements[i][target] for each global rank in ``ranks``: the rows of a plan over them.

    Args:
        specs: every target's spec, in plan order.
        ranks: the global ranks to place, in plan-row order.

    Returns:
        One list of Placements per rank.

    Example:
        >>> plan = build_plan(targets, dtypes, placements_for(specs, node_ranks), bucket_bytes)
    """
    return [[placement_for(s, r) for s in specs] for r in ranks]


def global_layout(spec: LayoutSpec, world: int) -> GlobalLayout:
    """What every rank knows of ``spec``'s layout over all ranks, without placing any rank.

    Shard and _StridedShard tile a tensor dim exactly once over their mesh dim
    (uneven and empty chunks included), so each element has one copy per
    Replicate coordinate and per sibling instance of the mesh; a plain tensor
    has one on every rank. Only the bucket boundaries depend on it, so a wrong
    count could cost memory, never a byte's place.

    Args:
        spec: the target's layout spec.
        world: the group's size (the holders of a plain tensor).

    Returns:
        Its GlobalLayout (dtype, copies, bound on its (rank, box) pairs).

    Example:
        >>> global_layout(LayoutSpec((8, 4), "BF16", MeshInfo((2, 4), tuple(range(8))), (Replicate(), Shard(0))), 8).copies
        2
    """
    if spec.mesh is None:
        return GlobalLayout(spec.dtype, world, world)
    size = 1
    for n in spec.mesh.shape:
        size *= n
    copies = len(spec.mesh.ranks) // max(size, 1)
    boxes = 1
    for n, p in zip(spec.mesh.shape, spec.placements, strict=True):
        if isinstance(p, Replicate):
            copies *= n
        elif isinstance(p, _StridedShard):
            boxes *= int(
                p.split_factor
            )  # each strided split can multiply the runs of a dim at most this much
    return GlobalLayout(spec.dtype, copies, len(spec.mesh.ranks) * boxes)


def spec_digest(names: Sequence[str], specs: Sequence[LayoutSpec]) -> str:
    """A short hash of every target's name and spec: equal on all ranks when their layouts agree.

    Args:
        names: the targets' names.
        specs: their specs, in the same order.

    Returns:
        32 hex characters.

    Example:
        >>> digests = all_gather_object(spec_digest(names, specs))  # one short string per rank
    """
    h = hashlib.sha256()
    seen: dict[int, str] = {}
    for name, s in zip(names, specs, strict=True):
        mesh = ""
        if s.mesh is not None:
            mesh = seen.get(id(s.mesh), "")
            if not mesh:
                mesh = seen[id(s.mesh)] = hashlib.sha256(
                    repr((s.mesh.shape, s.mesh.ranks)).encode()
                ).hexdigest()
        h.update(repr((name, s.shape, s.dtype, mesh, tuple(str(p) for p in s.placements))).encode())
    return h.hexdigest()[:32]
