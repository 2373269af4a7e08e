"""Save plan: the byte runs of the output files each rank writes from its own shards.

The loader's planner is run against the output layout as if it were a
checkpoint (``plan_conversions`` over the layout's tensor table): for every
model tensor it gives the pieces of hub tensors that tile it (a rename is one
piece, fused experts one piece per expert and projection). A rank's shard is
a box of the model tensor; ``regions_for_box`` cuts it into hub regions,
and a save writes each region back to where the load would have read it.

One replica writes: a DTensor is written by the ranks whose coordinate is 0
on every mesh dim it is replicated over, a plain tensor (a buffer FSDP2
leaves unsharded, or a model with no DTensor at all) by group rank 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import SaveError
from ..io.copy_ops import ITEMSIZE
from ..model.state import local_placement, local_tensor
from ..plan.convert import plan_conversions
from ..plan.regions import SourcePiece, box_numel, find_overlap, identity_piece, regions_for_box
from .layout import HubTensor, Layout, model_state

if TYPE_CHECKING:
    from .quantize import Fp8Blocks


@dataclass(frozen=True)
class Piece:
    """One region of a hub tensor this rank writes from one of its local shards.

    Attributes:
        target: model tensor name (its canonical name in the state dict).
        key: hub tensor name.
        local_start: start of the region in the local shard (model dims).
        shape: region shape in model dims.
        dims: hub dim per model dim (None: a size-1 stacked dim).
        src_start: start of the region in the hub tensor (hub dims).
    """

    target: str
    key: str
    local_start: tuple[int, ...]
    shape: tuple[int, ...]
    dims: tuple[int | None, ...]
    src_start: tuple[int, ...]

    def hub_shape(self) -> tuple[int, ...]:
        """The region's shape in hub dim order."""
        out = [1] * len(self.src_start)
        for d, s in enumerate(self.dims):
            if s is not None:
                out[s] = self.shape[d]
        return tuple(out)

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The region of ``local`` (this rank's shard) as a view in hub dim order."""
        v = local
        for d, (lo, n) in enumerate(zip(self.local_start, self.shape, strict=True)):
            v = v.narrow(d, lo, n)
        stacked = [d for d, s in enumerate(self.dims) if s is None]
        for d in reversed(stacked):
            v = v.squeeze(d)
        kept = [s for s in self.dims if s is not None]
        order = sorted(range(len(kept)), key=lambda i: kept[i])
        v = v.permute(order) if order != list(range(len(kept))) else v
        return v.reshape(self.hub_shape()) if v.dim() != len(self.src_start) else v


@dataclass
class SavePlan:
    """This rank's share of the output.

    Attributes:
        pieces: what this rank writes, ordered by (file, offset).
        tensors: target name -> this rank's model tensor (parameter or buffer).
        pieces_of: target name -> the hub pieces tiling it (same on every rank).
        fp8: with ``quantize="fp8"``, this rank's blocks (``save.quantize``): how its pieces of
            quantized tensors are quantized, once agreed.
    """

    pieces: list[Piece]
    tensors: dict[str, torch.Tensor]
    pieces_of: dict[str, tuple[SourcePiece, ...]]
    fp8: Fp8Blocks | None = None

    def bytes_to_write(self, layout: Layout) -> int:
        """The bytes this rank writes."""
        return sum(
            box_numel(tuple((0, n) for n in p.shape)) * ITEMSIZE[layout.tensors[p.key].dtype]
            for p in self.pieces
        )


def _unique(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Canonical name -> tensor (the first name of each object) and canonical -> every name."""
    tensors: dict[str, torch.Tensor] = {}
    names: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for name, t in model_state(model).items():
        canon = first.setdefault(id(t), name)
        if canon == name:
            tensors[name] = t
        names.setdefault(canon, []).append(name)
    return tensors, names


def tile_model(
    model: nn.Module, layout: Layout
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[SourcePiece, ...]]]:
    """The hub pieces that tile every model tensor, checked to cover each hub tensor once.

    Args:
        model: the model being saved.
        layout: its output layout.

    Returns:
        (canonical name -> the model tensor, canonical name -> its pieces).

    Raises:
        SaveError: a model tensor no hub tensor fills (or one built by an op with no
            region form), or a hub tensor not covered exactly once (the loader's mapping
            and transformers' reverse disagree).

    Example:
        >>> _, tiles = tile_model(qwen3_moe_model, output_layout(qwen3_moe_model))
        >>> len(tiles["model.layers.0.mlp.experts.gate_up_proj"])  # gate and up of each expert
        10
    """
    tensors, names = _unique(model)
    table = layout.table
    pieces: dict[str, tuple[SourcePiece, ...]] = {}
    rest: dict[str, tuple[int, ...]] = {}
    for canon, t in tensors.items():
        shape = tuple(int(s) for s in t.shape)
        key = next((n for n in names[canon] if n in table and tuple(table[n][1]) == shape), None)
        if key is not None:
            pieces[canon] = (identity_piece(key, shape),)
        else:
            rest[canon] = shape
    if rest:
        conv = plan_conversions(model, table, rest)
        for canon in rest:
            if (
                canon in conv.described
                and canon not in conv.pieces
                or any(p.key not in table for p in conv.pieces.get(canon, ()))
            ):
                # The loader materialises this op on its reader; a save has no such step.
                raise SaveError(
                    f"'{canon}' {list(rest[canon])} is built by transformers' "
                    f"{conv.described.get(canon, 'an op').removeprefix('fallback: ')}, which has no region "
                    "form: streamload cannot write it without materialising it",
                    tensor=canon,
                    hint="save this model with transformers' save_pretrained on gathered weights",
                )
            if canon not in conv.pieces:
                raise SaveError(f"no output tensor holds '{canon}' {list(rest[canon])}", tensor=canon)
            pieces[canon] = conv.pieces[canon]
    _check_once(pieces, table)
    return tensors, pieces


def _check_once(pieces: dict[str, tuple[SourcePiece, ...]], table: Mapping[str, tuple[Any, ...]]) -> None:
    """Raises SaveError unless the pieces cover every hub tensor of ``table`` exactly once.

    Element totals alone would pass two overlapping pieces whose sizes add up (one region
    written twice, another never written), so overlaps are looked for first, per hub tensor,
    on the pieces' boxes in hub coordinates.

    Args:
        pieces: model tensor name -> the hub pieces tiling it.
        table: hub tensor name -> (dtype, shape, file), as ``Layout.table`` gives it.

    Raises:
        SaveError: two pieces write the same elements of a hub tensor, or a hub tensor's
            elements are not all covered.
    """
    by_key: dict[str, list[SourcePiece]] = {key: [] for key in table}
    for ps in pieces.values():
        for p in ps:
            by_key[p.key].append(_in_hub(p))
    for key, found in by_key.items():
        hit = find_overlap(found)
        if hit is not None:
            a, b, both = hit
            raise SaveError(
                f"output tensor '{key}': two model pieces write the same elements {_fmt(both)} "
                f"(boxes {_fmt(a.dst_box)} and {_fmt(b.dst_box)}): the loader's mapping and "
                "transformers' reverse disagree",
                tensor=key,
            )
    for key, (_, shape, _) in table.items():
        n = box_numel(tuple((0, s) for s in shape))
        covered = sum(box_numel(p.dst_box) for p in by_key[key])
        if covered != n:
            raise SaveError(
                f"output tensor '{key}' {list(shape)}: model tensors cover {covered} of {n} elements",
                tensor=key,
            )


def _in_hub(p: SourcePiece) -> SourcePiece:
    """``p`` as a piece of its hub tensor: its box in hub coordinates (hub dims in order)."""
    shape = [1] * len(p.src_start)
    for d, s in enumerate(p.dims):
        if s is not None:
            shape[s] = p.shape[d]
    n = len(p.src_start)
    return SourcePiece(p.key, p.src_start, tuple(shape), p.src_start, tuple(range(n)))


def _fmt(box: tuple[tuple[int, int], ...]) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def _writes(t: torch.Tensor, group_rank: int) -> bool:
    """Whether this rank is the replica that writes ``t``."""
    if not (hasattr(t, "device_mesh") and hasattr(t, "placements")):
        return group_rank == 0
    from torch.distributed.tensor import Partial, Replicate

    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    for i, p in enumerate(t.placements):
        if isinstance(p, Partial):
            raise SaveError("a Partial (pending-reduction) DTensor cannot be saved: reduce it first")
        if isinstance(p, Replicate) and coord[i] != 0:
            return False
    return True


def _regions(name: str, t: torch.Tensor, pieces: tuple[SourcePiece, ...]) -> Iterator[Piece]:
    placement = local_placement(t, name)
    for box, local_start in placement.boxes:
        for r in regions_for_box(pieces, box):
            start = tuple(ls + bs for ls, bs in zip(local_start, r.box_start, strict=True))
            yield Piece(name, r.key, start, r.shape, r.dims, r.src_start)


def plan_save(
    model: nn.Module,
    layout: Layout,
    group_rank: int = 0,
    tiles: tuple[dict[str, torch.Tensor], dict[str, tuple[SourcePiece, ...]]] | None = None,
) -> SavePlan:
    """This rank's write pieces.

    Args:
        model: the model being saved.
        layout: its output layout (``output_layout``).
        group_rank: this rank in the save's group (plain tensors are written by rank 0).
        tiles: ``tile_model(model, layout)`` when already made (an fp8 save tiles the model
            against its unquantized layout, whose keys the fp8 layout keeps).

    Returns:
        The SavePlan, pieces ordered by file and offset.

    Example:
        >>> plan = plan_save(model, output_layout(model), dist.get_rank())
        >>> sum(p.shape[0] for p in plan.pieces) > 0
        True
    """
    tensors, pieces_of = tiles if tiles is not None else tile_model(model, layout)
    out: list[Piece] = []
    for name, t in tensors.items():
        if _writes(t, group_rank):
            out.extend(_regions(name, t, pieces_of[name]))
    out.sort(key=lambda p: (layout.tensors[p.key].file, _first_byte(layout.tensors[p.key], p)))
    return SavePlan(out, tensors, pieces_of)


def _first_byte(h: HubTensor, p: Piece) -> int:
    off, stride = 0, ITEMSIZE[h.dtype]
    for s, size in zip(reversed(p.src_start), reversed(h.shape), strict=True):
        off += s * stride
        stride *= size
    return h.offset + off


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of ``t`` (the tensor itself when it is not a DTensor), detached.

    Example:
        >>> local_of(fsdp_param).shape  # dim 0 split over the ranks
        torch.Size([43, 32])
    """
    return local_tensor(t).detach()
