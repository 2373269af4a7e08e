"""Whole-tensor dequantization on the reader: one quantized checkpoint tensor
and its scales read into a full float32 tensor by the native dequant op (the
same op, and so the same bits, as the streamed path), for the places that need
a whole logical tensor: transformers' ops in a conversion fallback."""

from __future__ import annotations

from typing import Any

import torch

from .copy_ops import OpBatch, contiguous_strides
from .quantized import QuantTensor


def read_dequantized(source: Any, q: QuantTensor) -> torch.Tensor:
    """Reads logical tensor ``q`` whole, dequantized, as float32.

    Args:
        source: the opened checkpoint (``info``, ``engine`` and ``files``).
        q: a logical tensor from ``quantized_view``.

    Returns:
        A contiguous float32 tensor of shape ``q.shape``: every value times its
        scale, formed in float32 exactly as the streamed path forms it.

    Example:
        >>> w = read_dequantized(ckpt, quant["model.layers.0.mlp.experts.0.up_proj.weight"])
    """
    out = torch.empty(q.shape, dtype=torch.float32)
    logical = contiguous_strides(q.shape)
    w, s = source.info(q.weight), source.info(q.scale)
    batch = OpBatch()
    batch.add_dequant(
        kind=q.kind,
        weight=(w.file_index, w.begin, w.nbytes, w.dtype),
        scale=(s.file_index, s.begin, s.nbytes, s.dtype),
        dst=out,
        dst_dtype="F32",
        dims=q.dims,
        block=q.block,
        box=[(0, d) for d in q.dims],
        dst_offset=0,
        # Each op dim walks one logical axis (None: a dim of size 1).
        dst_strides=[0 if a is None else logical[a] for a in q.axes],
    )
    batch.execute(source.engine, source.files)
    return out


__all__ = ["read_dequantized"]
