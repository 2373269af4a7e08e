"""Quantized checkpoints as region algebra: a quantized tensor and its scales
become one logical (dequantized) source tensor that the planner tiles like
any other, so per-expert tensors fuse and shards slice the same way. The
pack side turns each region of a logical tensor into one dequantizing op
that reads only the quantized bytes and scale rows the region needs.

Two schemes, as transformers loads them (``quantization_config``):

- ``fp8`` with ``weight_block_size`` [br, bc] (DeepSeek-V3): ``X.weight``
  float8 [.., R, C] + ``X.weight_scale_inv`` float32 [.., ceil(R/br),
  ceil(C/bc)] -> logical ``X.weight`` [.., R, C].
- ``mxfp4`` (GPT-OSS): ``X_blocks`` uint8 [E, R, G, 16] + ``X_scales`` uint8
  [E, R, G] -> logical ``X`` [E, G*32, R] (transformers' layout after its
  final transpose).

Pure: no I/O, no torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from ..io.quantized import QuantTensor
from .regions import SourceRegion

# The logical dtype of a dequantized tensor: the product is formed in float32,
# so the wire carries the parameter's dtype (never wider than float32).
LOGICAL_DTYPE = "F32"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")

Table = dict[str, tuple[str, tuple[int, ...], str]]


class QuantizationError(CheckpointError):
    """A quantized tensor and its scales do not fit together."""


@dataclass(frozen=True)
class QuantScheme:
    """What ``config.json``'s ``quantization_config`` says.

    Attributes:
        method: ``"fp8"`` or ``"mxfp4"``.
        block: FP8 ``weight_block_size`` (rows, cols), None when not given.
    """

    method: str
    block: tuple[int, int] | None = None


def scheme_from_config(config: Any) -> QuantScheme | None:
    """The quantization scheme of a transformers config (or config dict), if any.

    Args:
        config: a ``PretrainedConfig``, a ``config.json`` dict, or None.

    Returns:
        The scheme, or None when the config has no supported ``quantization_config``.

    Example:
        >>> scheme_from_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
        QuantScheme(method='fp8', block=(128, 128))
    """
    if config is None:
        return None
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if qc is None and not isinstance(config, Mapping):
        qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", ""))
    if method == "fp8":
        block = qc.get("weight_block_size")
        return QuantScheme("fp8", (int(block[0]), int(block[1])) if block else None)
    if method == "mxfp4":
        return QuantScheme("mxfp4")
    return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_block(
    shape: Sequence[int], grid: Sequence[int], block: tuple[int, int] | None, key: str
) -> tuple[int, int]:
    """The block of one FP8 weight.

    transformers' ``Fp8Dequantize`` ignores the config and derives the block
    from the grid (``rows // grid_rows``), refusing a grid that does not divide
    the weight. With no configured block that derivation is used (and a grid
    it cannot divide is refused, loudly: the block would be a guess). A
    configured block is checked against the grid and used, as the quantizer
    used it; where transformers' derivation would scale some rows or columns
    differently, a warning names the tensor.
    """
    rows, cols = shape[-2], shape[-1]
    sr, sc = grid[-2], grid[-1]
    derived = (rows // sr, cols // sc) if sr > 0 and sc > 0 and rows % sr == 0 and cols % sc == 0 else None
    if block is None:
        if derived is None or min(derived) <= 0:
            raise QuantizationError(
                f"scale grid {list(grid)} does not divide weight {list(shape)} and the config gives no "
                "weight_block_size (transformers refuses this grid): set quantization_config.weight_block_size",
                None,
                key,
            )
        return derived
    br, bc = block
    if br <= 0 or bc <= 0 or _cdiv(rows, br) != sr or _cdiv(cols, bc) != sc:
        raise QuantizationError(
            f"scale grid {list(grid)} does not match weight {list(shape)} with block {list(block)}", None, key
        )
    # With one block along a dim every element shares its scale, whatever the block size.
    differs = derived is None or (sr > 1 and derived[0] != br) or (sc > 1 and derived[1] != bc)
    if differs:
        theirs = f"derives {list(derived)}" if derived else "refuses this grid"
        warnings.warn(
            f"streamload: '{key}' {list(shape)} is dequantized with the configured block {list(block)}, "
            f"as it was quantized; transformers' from_pretrained {theirs}, so its values differ",
            stacklevel=4,
        )
    return br, bc


def fp8_scale_key(key: str) -> str:
    """``a.weight`` -> ``a.weight_scale_inv``; other names get ``_scale_inv``."""
    return key[: -len("weight")] + "weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"


def quantized_view(table: Table, scheme: QuantScheme | None) -> tuple[Table, dict[str, QuantTensor]]:
    """The table as the model sees it: quantized tensors become logical ones
    and their scales are consumed (neither matched nor unexpected).

    Args:
        table: checkpoint key -> (dtype, shape, file).
        scheme: from ``scheme_from_config``; None detects FP8 weights that have
            a ``weight_scale_inv`` sibling (block derived from the grid, as
            transformers derives it).

    Returns:
        (the logical table, logical key -> QuantTensor).

    Example:
        >>> view, quant = quantized_view(table, QuantScheme("fp8", (128, 128)))
    """
    method = scheme.method if scheme is not None else "fp8"
    out: Table = dict(table)
    quant: dict[str, QuantTensor] = {}
    if method == "fp8":
        block = scheme.block if scheme is not None else None
        for key, (dtype, shape, file) in table.items():
            skey = fp8_scale_key(key)
            if dtype not in FP8_DTYPES or skey not in table or len(shape) not in (2, 3):
                continue
            grid = table[skey][1]
            if len(grid) != len(shape) or tuple(grid[:-2]) != tuple(shape[:-2]):
                raise QuantizationError(
                    f"scale shape {list(grid)} does not fit weight {list(shape)}", file, key
                )
            br, bc = _fp8_block(shape, grid, block, key)
            axes: tuple[int | None, int | None, int | None] = (None, 0, 1) if len(shape) == 2 else (0, 1, 2)
            dims = (1, shape[0], shape[1]) if len(shape) == 2 else (shape[0], shape[1], shape[2])
            quant[key] = QuantTensor(key, "fp8_block", key, skey, tuple(shape), axes, dims, (br, bc))
            out[key] = (LOGICAL_DTYPE, tuple(shape), file)
            out.pop(skey, None)
    elif method == "mxfp4":
        for key, (dtype, shape, file) in table.items():
            if not key.endswith("_blocks") or key[: -len("_blocks")] + "_scales" not in table:
                continue
            base = key[: -len("_blocks")]
            skey = base + "_scales"
            sdtype, sshape = table[skey][0], table[skey][1]
            if sdtype != "U8":
                # transformers reads them as e8m0 exponent bytes (``scales.to(int32) - 127``):
                # any other dtype would be scaled by a different number.
                raise QuantizationError(
                    f"MXFP4 scales '{skey}' are {sdtype}; transformers reads U8 exponent bytes", file, skey
                )
            if len(shape) != 4 or shape[-1] != 16 or tuple(sshape) != tuple(shape[:-1]) or dtype != "U8":
                raise QuantizationError(
                    f"MXFP4 blocks {dtype}{list(shape)} and scales {list(sshape)} do not fit", file, key
                )
            n_exp, rows, groups = shape[0], shape[1], shape[2]
            logical = (n_exp, groups * 32, rows)
            quant[base] = QuantTensor(
                base, "mxfp4", key, skey, logical, (0, 2, 1), (n_exp, rows, groups * 32), (1, 32)
            )
            out[base] = (LOGICAL_DTYPE, logical, file)
            out.pop(key, None)
            out.pop(skey, None)
    return out, quant


@dataclass(frozen=True)
class DequantRegion:
    """One dequantizing op's geometry for a region of a logical tensor.

    Attributes:
        box: (start, size) per op dim (batch, rows, cols).
        strides: destination element strides per op dim.
        offset: element offset of the box's first value in the destination,
            relative to the region's destination origin.
    """

    box: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    strides: tuple[int, int, int]


def dequant_region(q: QuantTensor, reg: SourceRegion, dst_strides: Sequence[int]) -> DequantRegion:
    """Maps a region of logical tensor ``q`` (destination dims ``reg.dims``)
    onto the op's (batch, rows, cols) box with destination strides.

    Args:
        q: the logical tensor.
        reg: a region from ``regions_for_box`` over pieces of ``q.key``.
        dst_strides: element strides of the destination dims.

    Returns:
        The op box and strides; the caller adds the region's destination offset.

    Example:
        >>> dequant_region(q, reg, [256, 1]).box
        ((0, 1), (77, 100), (0, 256))
    """
    box: list[tuple[int, int]] = []
    strides: list[int] = []
    for axis in q.axes:
        if axis is None:
            box.append((0, 1))
            strides.append(0)
            continue
        start, size, stride = reg.src_start[axis], 1, 0
        for d, src_dim in enumerate(reg.dims):
            if src_dim == axis:
                size, stride = reg.shape[d], int(dst_strides[d])
        box.append((start, size))
        strides.append(stride)
    return DequantRegion((box[0], box[1], box[2]), (strides[0], strides[1], strides[2]))


def check_kept(
    targets: Sequence[Any], dtypes: Sequence[str], quant: Mapping[str, QuantTensor], table: Table
) -> None:
    """With ``quantized="keep"``, a quantized tensor must land in a parameter of
    its own dtype: widening fp8 without its scales would load wrong values.

    Args:
        targets: the plan's targets (with ``name`` and ``pieces``).
        dtypes: this rank's parameter dtype per target.
        quant: what ``quantized_view`` found.
        table: the checkpoint's table.

    Raises:
        DTypeMismatchError naming the parameter and tensor.
    """
    from ..errors import DTypeMismatchError

    weights = {q.weight for q in quant.values()}
    for t, dtype in zip(targets, dtypes, strict=True):
        for p in t.pieces:
            if p.key in weights and table[p.key][0] != dtype:
                raise DTypeMismatchError(
                    f"'{p.key}' is stored quantized ({table[p.key][0]}) and quantized='keep' needs a "
                    f"{table[p.key][0]} parameter, but '{t.name}' is {dtype}: pass quantized='dequantize'",
                    table[p.key][2],
                    p.key,
                )


def quant_groups(quant: Mapping[str, QuantTensor]) -> list[tuple[str, str, tuple[int, int], int]]:
    """Quantized tensors grouped by name pattern (layer and expert numbers as
    ``*``), for ``streamload inspect``.

    Returns:
        (pattern, kind, block, tensors) per group, sorted by pattern.

    Example:
        >>> quant_groups(quant)[0]
        ('model.layers.*.mlp.experts.*.down_proj.weight', 'fp8_block', (128, 128), 58)
    """
    import re

    groups: dict[tuple[str, str, tuple[int, int]], int] = {}
    for q in quant.values():
        key = (re.sub(r"\.\d+\.", ".*.", q.key), q.kind, q.block)
        groups[key] = groups.get(key, 0) + 1
    return [(p, k, b, n) for (p, k, b), n in sorted(groups.items())]


__all__ = [
    "LOGICAL_DTYPE",
    "DequantRegion",
    "QuantScheme",
    "QuantTensor",
    "QuantizationError",
    "dequant_region",
    "check_kept",
    "quant_groups",
    "fp8_scale_key",
    "quantized_view",
    "scheme_from_config",
]
