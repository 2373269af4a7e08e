"""fp8 export: ``save_pretrained(..., quantize="fp8")`` writes DeepSeek-V3's block-scaled format.

What is quantized is what transformers' ``FineGrainedFP8HfQuantizer`` converts: the weight of
every plain ``nn.Linear`` and the weights of every fused ``*.experts`` module, less transformers'
default skips (``get_keys_to_not_convert``: the output embeddings, tied weights, the last
module; ``_keep_in_fp32_modules``) and less router gates (a Linear named ``gate`` /
``*_gate`` / ``router``, which vLLM and DeepSeek-V3 keep in bf16). A weight is quantized only
when its hub tensor's last two dims are multiples of the block (transformers' ``Fp8Quantize``
passes other shapes through); a module with any weight left as it was is named in
``modules_to_not_convert``, so transformers and vLLM build it unquantized. Embeddings, norms,
biases and every 1-D tensor keep their dtype (the save's ``dtype`` when given).

Each quantized hub tensor ``X.weight`` becomes float8_e4m3fn plus ``X.weight_scale_inv``
(float32, one per 128x128 block of the last two dims), with transformers' own arithmetic
(``Fp8Quantize``): ``scale = 448 / amax`` (1 where amax is 0), ``q = (w.float() * scale)
.clamp(-448, 448).to(float8_e4m3fn)``, ``weight_scale_inv = 1 / scale``. The input is the
tensor as the save would write it (cast to ``dtype`` first when given).

Per rank, on the blocks of its own shard. A block a rank holds whole (inside one of its
pieces) is final locally. A block cut by a piece's edge (an FSDP dim-0 shard boundary inside a
block: 3 ranks over 256 rows cut rows 86 and 172) has its amax agreed: one ``all_gather`` of
(block id, partial amax) of the cut blocks only, every rank taking the max over every rank's
partials of the blocks it holds (max is exact and order-free, and a copy of a shard held on
two meshes contributes the same value twice harmlessly). Each block's scale is written by the
rank whose piece holds the block's first element, as one more piece of the plan, so the exact
tiling check covers the scales too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import SaveError
from ..io.copy_ops import TORCH_DTYPES
from ..plan.buckets import split_box
from ..plan.quant import fp8_scale_key
from ..plan.regions import Box, SourcePiece
from ..transport.collectives import all_gather_object, solo
from .layout import Layout, hub_state, layout_of, output_layout
from .plan import Piece, SavePlan, _first_byte, local_of, plan_save, tile_model

QUANTIZE = (None, "fp8")
FP8_BLOCK = (128, 128)
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0, transformers' _FP8_MAX
_FP8_MIN = float(torch.finfo(FP8_DTYPE).min)
# Bytes per element of the float32 temporaries that quantizing a cut of a piece makes (the
# value, its scales, the product): a cut of a quantized piece holds bucket / 12 elements.
_QUANT_TEMP_ITEMSIZE = 12


@dataclass(frozen=True)
class Fp8Choice:
    """Which hub tensors a save quantizes.

    Attributes:
        keys: hub keys written as float8_e4m3fn (each with a ``weight_scale_inv``).
        kept: the modules left unquantized that transformers would otherwise convert, plus its
            default skips: ``quantization_config.modules_to_not_convert``.
        block: the scale block (rows, cols).
    """

    keys: frozenset[str]
    kept: tuple[str, ...]
    block: tuple[int, int] = FP8_BLOCK

    def config(self) -> dict[str, Any]:
        """``config.json``'s ``quantization_config``: DeepSeek-V3's keys, and transformers'
        ``modules_to_not_convert`` (checkpoint-side names; transformers renames them to its own)."""
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(self.block),
            "modules_to_not_convert": list(self.kept),
        }


def _is_linear(module: nn.Module | None) -> bool:
    """A plain ``nn.Linear`` (``fully_shard`` makes ``FSDPLinear``, still plain underneath)."""
    if module is None:
        return False
    cls = type(module)
    return cls is nn.Linear or (cls.__name__ == "FSDPLinear" and nn.Linear in cls.__bases__)


def _is_gate(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("gate", "router") or leaf.endswith("_gate") or "router" in leaf


def _default_skips(model: nn.Module) -> list[str]:
    """transformers' own skips when ``modules_to_not_convert`` is not given."""
    try:
        from transformers.modeling_utils import PreTrainedModel
        from transformers.quantizers.base import get_keys_to_not_convert
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    skips = list(get_keys_to_not_convert(model))
    skips += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    return skips


def _skipped(name: str, patterns: list[str]) -> bool:
    try:
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:
        return any(name == p or name.startswith(p + ".") or name.endswith(p) for p in patterns)
    return not should_convert_module(name, patterns)


def _blockable(shape: tuple[int, ...], dtype: str, block: tuple[int, int]) -> bool:
    if len(shape) < 2 or not TORCH_DTYPES[dtype].is_floating_point:
        return False
    return shape[-2] > 0 and shape[-1] > 0 and shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0


def choose_fp8(
    model: nn.Module,
    logical: Layout,
    tiles: Mapping[str, tuple[SourcePiece, ...]],
    block: tuple[int, int] = FP8_BLOCK,
) -> Fp8Choice:
    """The hub tensors to quantize and the modules left as they are.

    Args:
        model: the model being saved.
        logical: its unquantized output layout (``output_layout``).
        tiles: model tensor name -> the hub pieces tiling it (``tile_model``).
        block: the scale block.

    Returns:
        The Fp8Choice (the same on every rank: it depends on names and global shapes only).

    Example:
        >>> choose_fp8(model, layout, tile_model(model, layout)[1]).kept
        ('lm_head', 'model.layers.0.self_attn.k_proj', ...)
    """
    modules = dict(model.named_modules())
    skips = _default_skips(model)
    weights: dict[str, list[str]] = {}
    for target, pieces in tiles.items():
        owner, _, leaf = target.rpartition(".")
        convertible = _is_linear(modules.get(owner)) or owner.endswith(".experts")
        if convertible and "bias" not in leaf:
            weights.setdefault(owner, []).extend(p.key for p in pieces)
    keys: set[str] = set()
    kept = set(skips)
    for owner, hub_keys in weights.items():
        tensors = [logical.tensors[k] for k in hub_keys]
        if (
            _skipped(owner, skips)
            or _is_gate(owner)
            or not all(_blockable(t.shape, t.dtype, block) for t in tensors)
        ):
            kept.add(owner)
        else:
            keys.update(hub_keys)
    return Fp8Choice(frozenset(keys), tuple(sorted(kept)), block)


def fp8_layout(
    model: nn.Module, choice: Fp8Choice, dtype: torch.dtype | None, max_shard_size: int | str
) -> Layout:
    """The output layout with ``choice``'s tensors in float8_e4m3fn, each followed by its
    float32 ``weight_scale_inv``; files, headers and index planned as for any save.

    Example:
        >>> fp8_layout(model, choice, None, "5GB").tensors["model.layers.0.mlp.up_proj.weight"].dtype
        'F8_E4M3'
    """
    br, bc = choice.block
    hub: dict[str, torch.Tensor] = {}
    for key, t in hub_state(model, dtype).items():
        if key not in choice.keys:
            hub[key] = t
            continue
        *lead, rows, cols = t.shape
        hub[key] = torch.empty(tuple(t.shape), dtype=FP8_DTYPE, device="meta")
        hub[fp8_scale_key(key)] = torch.empty(
            (*lead, rows // br, cols // bc), dtype=torch.float32, device="meta"
        )
    return layout_of(hub, model, max_shard_size)


@dataclass
class _Grid:
    """The blocks one piece of a quantized hub tensor touches.

    Attributes:
        start: block coordinates of ``amax[0, ...]`` (leading dims in elements, the last two in blocks).
        amax: float32 per block; partial for the blocks ``cut`` marks until agreed.
        cut: the blocks this piece holds only part of.
        scale: float32 ``448 / amax`` (transformers' form), once agreed.
        inv: float32 ``weight_scale_inv``, once agreed.
    """

    start: tuple[int, ...]
    amax: torch.Tensor
    cut: torch.Tensor
    scale: torch.Tensor | None = None
    inv: torch.Tensor | None = None


@dataclass
class Fp8Blocks:
    """This rank's blocks: one grid per quantized piece, and how to quantize a cut of it.

    Attributes:
        choice: what is quantized.
        dtypes: hub key -> the dtype the save would write it in unquantized (the quantizer's input).
        grids: piece -> its grid.
    """

    choice: Fp8Choice
    dtypes: dict[str, torch.dtype]
    grids: dict[Piece, _Grid] = field(default_factory=dict)

    def itemsize(self, piece: Piece, itemsize: int) -> int:
        """Bytes per element to cut ``piece`` by (its float32 temporaries, when quantized)."""
        return _QUANT_TEMP_ITEMSIZE if piece in self.grids else itemsize

    def quantize(self, piece: Piece, sub: Box, part: torch.Tensor) -> torch.Tensor:
        """``part`` (the hub-order values of ``sub``, a box inside ``piece``) as float8_e4m3fn,
        or ``part`` itself when ``piece`` is not quantized."""
        grid = self.grids.get(piece)
        if grid is None:
            return part
        assert grid.scale is not None, "quantize before the blocks were agreed"
        br, bc = self.choice.block
        lead = tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(sub[:-2], grid.start, strict=False))
        (r0, r1), (c0, c1) = sub[-2], sub[-1]
        dev = part.device  # the host: the writers stage device pieces first (save/stage.py)
        rows = torch.arange(r0, r1, device=dev) // br - grid.start[-2]
        cols = torch.arange(c0, c1, device=dev) // bc - grid.start[-1]
        scale = grid.scale[lead].to(dev).index_select(-2, rows).index_select(-1, cols)
        x = _as_saved(part, self.dtypes[piece.key])
        return (x * scale).clamp(min=_FP8_MIN, max=_FP8_MAX).to(FP8_DTYPE)


def _as_saved(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``part`` as the save would write it unquantized, in float32 (transformers' ``value.to(float32)``)."""
    return part.to(dtype).to(torch.float32)


def _hub_box(piece: Piece) -> Box:
    return tuple((s, s + n) for s, n in zip(piece.src_start, piece.hub_shape(), strict=True))


def measure_blocks(plan: SavePlan, logical: Layout, choice: Fp8Choice, bucket_bytes: int) -> Fp8Blocks:
    """Local: the amax of every block this rank's quantized pieces touch (partial where cut).

    Args:
        plan: this rank's pieces (``plan_save`` against the fp8 layout).
        logical: the unquantized layout (each hub tensor's dtype before quantizing).
        choice: what is quantized.
        bucket_bytes: the largest float32 temporary, in bytes.

    Returns:
        Fp8Blocks with one grid per quantized piece (amax of cut blocks still partial).

    Example:
        >>> blocks = measure_blocks(plan, logical, choice, 64 << 20)
    """
    dtypes = {k: logical.tensors[k].torch_dtype for k in choice.keys}
    blocks = Fp8Blocks(choice, dtypes)
    br, bc = choice.block
    for piece in plan.pieces:
        if piece.key not in choice.keys:
            continue
        box = _hub_box(piece)
        (r0, r1), (c0, c1) = box[-2], box[-1]
        lead = tuple(hi - lo for lo, hi in box[:-2])
        nr, nc = -(-r1 // br) - r0 // br, -(-c1 // bc) - c0 // bc
        grid = _Grid(
            tuple(lo for lo, _ in box[:-2]) + (r0 // br, c0 // bc),
            torch.zeros((*lead, nr, nc), dtype=torch.float32),
            _cut_mask(lead, (r0, r1), (c0, c1), br, bc),
        )
        src = piece.view(local_of(plan.tensors[piece.target]))
        for sub in split_box(box, _QUANT_TEMP_ITEMSIZE, bucket_bytes):  # float32 value, |value|, padded
            part = src
            for d, ((lo, hi), (b0, _)) in enumerate(zip(sub, box, strict=True)):
                part = part.narrow(d, lo - b0, hi - lo)
            _fold_amax(grid, sub, _as_saved(part, dtypes[piece.key]).abs(), br, bc)
        blocks.grids[piece] = grid
    return blocks


def _cut_mask(
    lead: tuple[int, ...], rows: tuple[int, int], cols: tuple[int, int], br: int, bc: int
) -> torch.Tensor:
    """The blocks of a piece spanning ``rows`` x ``cols`` that it holds only part of."""

    def edges(lo: int, hi: int, b: int) -> torch.Tensor:
        n = -(-hi // b) - lo // b
        cut = torch.zeros(n, dtype=torch.bool)
        cut[0] |= lo % b != 0
        cut[-1] |= hi % b != 0
        return cut

    r, c = edges(*rows, br), edges(*cols, bc)
    return (r[:, None] | c[None, :]).expand(*lead, -1, -1).clone()


def _fold_amax(grid: _Grid, sub: Box, x: torch.Tensor, br: int, bc: int) -> None:
    """Max of ``x`` (|values| of ``sub``) per block, into ``grid``."""
    (r0, r1), (c0, c1) = sub[-2], sub[-1]
    # Zeros pad the cut to whole blocks: |values| >= 0, so no block's max changes.
    x = F.pad(x, (c0 % bc, (-c1) % bc, r0 % br, (-r1) % br))
    *lead, rows, cols = x.shape
    per_block = x.reshape(*lead, rows // br, br, cols // bc, bc).amax(dim=(-3, -1)).cpu()
    at = [slice(lo - s, hi - s) for (lo, hi), s in zip(sub[:-2], grid.start, strict=False)]
    at.append(slice(r0 // br - grid.start[-2], r0 // br - grid.start[-2] + rows // br))
    at.append(slice(c0 // bc - grid.start[-1], c0 // bc - grid.start[-1] + cols // bc))
    view = grid.amax[tuple(at)]
    torch.maximum(view, per_block, out=view)


def _block_ids(grid: _Grid, scale_shape: tuple[int, ...]) -> torch.Tensor:
    """Flat indices in the scale tensor of every block of ``grid`` (row-major)."""
    idx = torch.zeros(grid.amax.shape, dtype=torch.int64)
    stride = 1
    for d in range(len(scale_shape) - 1, -1, -1):
        n = grid.amax.shape[d]
        shape = [1] * len(scale_shape)
        shape[d] = n
        idx += (torch.arange(n, dtype=torch.int64) + grid.start[d]).reshape(shape) * stride
        stride *= scale_shape[d]
    return idx


def agree_blocks(
    blocks: Fp8Blocks, layout: Layout, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Collective: the amax of every cut block agreed (the max of every rank's part of it),
    then every grid's scales. One ``all_gather`` of the cut blocks' (id, partial amax) only.

    Args:
        blocks: this rank's grids (``measure_blocks``).
        layout: the fp8 layout (scale tensors' shapes).
        group: the save's agreement group (None: one process).
        device: where the gathered objects travel.

    Example:
        >>> agree_blocks(blocks, layout, out.group, out.device)
    """
    keys = sorted(blocks.choice.keys)
    index = {k: i for i, k in enumerate(keys)}
    cut_of: dict[Piece, torch.Tensor] = {}
    payload: Any
    try:
        mine: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for piece, grid in blocks.grids.items():
            if not bool(grid.cut.any()):
                continue
            ids = _block_ids(grid, layout.tensors[fp8_scale_key(piece.key)].shape)[grid.cut]
            cut_of[piece] = ids
            mine.setdefault(index[piece.key], []).append((ids, grid.amax[grid.cut]))
        payload = {k: (torch.cat([i for i, _ in v]), torch.cat([a for _, a in v])) for k, v in mine.items()}
    except Exception as exc:  # noqa: BLE001 - told to the peers in the same gather, raised on every rank
        payload = f"{type(exc).__name__}: {exc}"
    gathered = [payload] if solo(group) else all_gather_object(payload, group, device)
    failed = [(r, g) for r, g in enumerate(gathered) if isinstance(g, str)]
    if failed:
        raise SaveError(f"agreeing the fp8 blocks failed on group rank {failed[0][0]}: {failed[0][1]}")
    for piece, ids in cut_of.items():
        k = index[piece.key]
        parts = [g[k] for g in gathered if k in g]
        all_ids = torch.cat([i for i, _ in parts])
        all_amax = torch.cat([a for _, a in parts])
        uniq, inverse = torch.unique(all_ids, return_inverse=True)
        top = torch.full((uniq.numel(),), -math.inf, dtype=torch.float32)
        top = top.scatter_reduce(0, inverse, all_amax, "amax")
        grid = blocks.grids[piece]
        grid.amax[grid.cut] = top[torch.searchsorted(uniq, ids)]
    for grid in blocks.grids.values():
        grid.scale, grid.inv = fp8_scales(grid.amax)


def fp8_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, weight_scale_inv) of per-block amax, exactly as transformers' ``Fp8Quantize``
    forms them (``448 / amax`` is torch's reciprocal-then-multiply, one rounding each).

    Example:
        >>> fp8_scales(torch.tensor([2.0, 0.0]))[1]
        tensor([0.0045, 1.0000])
    """
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scales = _FP8_MAX / safe
    scales = torch.where(amax > 0, scales, torch.ones_like(scales))
    inv = (1.0 / scales).to(torch.float32)
    return scales, inv


def with_scale_pieces(plan: SavePlan, blocks: Fp8Blocks, layout: Layout) -> SavePlan:
    """``plan`` plus the scale pieces this rank writes: each block's ``weight_scale_inv`` by
    the piece that holds the block's first element.

    Example:
        >>> plan = with_scale_pieces(plan, blocks, layout)
    """
    br, bc = blocks.choice.block
    tensors = dict(plan.tensors)
    extra: list[Piece] = []
    for piece, grid in blocks.grids.items():
        assert grid.inv is not None, "scale pieces before the blocks were agreed"
        box = _hub_box(piece)
        (r0, r1), (c0, c1) = box[-2], box[-1]
        first_r, first_c = -(-r0 // br), -(-c0 // bc)  # the first block starting inside the piece
        end_r, end_c = -(-r1 // br), -(-c1 // bc)
        if first_r >= end_r or first_c >= end_c:
            continue
        lead = [(lo, hi) for lo, hi in box[:-2]]
        start = (*(lo for lo, _ in lead), first_r, first_c)
        shape = (*(hi - lo for lo, hi in lead), end_r - first_r, end_c - first_c)
        values = grid.inv[..., first_r - grid.start[-2] : end_r - grid.start[-2], first_c - grid.start[-1] :]
        values = values[..., : end_c - first_c].contiguous()
        target = f"{piece.key}#scale{list(start)}"
        tensors[target] = values
        n = len(start)
        extra.append(Piece(target, fp8_scale_key(piece.key), (0,) * n, shape, tuple(range(n)), start))
    pieces = sorted(
        plan.pieces + extra, key=lambda p: (layout.tensors[p.key].file, _first_byte(layout.tensors[p.key], p))
    )
    return replace(plan, pieces=pieces, tensors=tensors, fp8=blocks)


def plan_fp8(
    model: nn.Module, dtype: torch.dtype | None, max_shard_size: int | str, group_rank: int, bucket_bytes: int
) -> tuple[Layout, SavePlan]:
    """Local: the fp8 layout and this rank's plan, its blocks measured (cut blocks' amax partial).

    The model is tiled against its unquantized layout (the loader's planner reads a checkpoint
    table, where fp8 weights and scales would be a quantized checkpoint), whose keys, shapes and
    order the fp8 layout keeps.

    Example:
        >>> layout, plan = plan_fp8(model, None, "5GB", rank, 64 << 20)
    """
    logical = output_layout(model, dtype=dtype, max_shard_size=max_shard_size)
    tiles = tile_model(model, logical)
    choice = choose_fp8(model, logical, tiles[1])
    layout = fp8_layout(model, choice, dtype, max_shard_size)
    plan = plan_save(model, layout, group_rank, tiles)
    return layout, replace(plan, fp8=measure_blocks(plan, logical, choice, bucket_bytes))


def agree_fp8(
    plan: SavePlan, layout: Layout, group: dist.ProcessGroup | None, device: torch.device
) -> SavePlan:
    """Collective: the cut blocks' amax agreed, the scales formed, and the scale pieces this
    rank writes added to ``plan``.

    Example:
        >>> plan = agree_fp8(plan, layout, out.group, out.device)
    """
    assert plan.fp8 is not None
    agree_blocks(plan.fp8, layout, group, device)
    return with_scale_pieces(plan, plan.fp8, layout)
