"""How a quantized checkpoint tensor lies in the files: the description both
the file layer (whole-tensor dequantization, ``dequant.py``) and the planner
(``plan/quant.py``, which builds these from a checkpoint's table) share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantTensor:
    """A logical tensor the checkpoint stores quantized.

    Attributes:
        key: the logical key (what model keys and conversions match).
        kind: native op kind, ``"fp8_block"`` or ``"mxfp4"``.
        weight: checkpoint key of the quantized values.
        scale: checkpoint key of the scales.
        shape: logical shape.
        axes: the logical dim that walks the op's batch, rows and cols (None: size 1).
        dims: the op's (batch, rows, cols).
        block: values per scale, (rows, cols).
    """

    key: str
    kind: str
    weight: str
    scale: str
    shape: tuple[int, ...]
    axes: tuple[int | None, int | None, int | None]
    dims: tuple[int, int, int]
    block: tuple[int, int]


__all__ = ["QuantTensor"]
