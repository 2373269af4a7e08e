"""Copy-op batches for the native engine: one row of int64 per op."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _native

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "F32": torch.float32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
ST_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
FLOAT_FAMILY = frozenset({"F16", "BF16", "F32", "F64"})
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in TORCH_DTYPES.items()}


_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits, flat, as integers of its width: ``torch.equal`` on two of them is bit equality.

    Example:
        >>> torch.equal(bit_view(a), bit_view(b))  # NaN payloads and -0.0 included
    """
    t = t.detach().contiguous().reshape(-1)
    return t.view(_SAME_WIDTH_INTS[t.element_size()])


def can_convert(src: str, dst: str) -> bool:
    """True when the native engine casts ``src`` to ``dst`` (same type, or both floating)."""
    return src == dst or (src in FLOAT_FAMILY and dst in FLOAT_FAMILY)


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Row-major element strides of ``shape``."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(int(shape[i + 1]), 1)
    return strides


class OpBatch:
    """Accumulates copy ops and runs them in one native call.

    Example:
        >>> batch = OpBatch()
        >>> batch.add(file=0, src=0, src_nbytes=16, src_dtype="F32", dst=out, dst_dtype="F32",
        ...           shape=[4], src_strides=[1], dst_strides=[1])
        >>> batch.execute(engine, files)
    """

    def __init__(self) -> None:
        self._rows: list[list[int]] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(
        self,
        *,
        file: int,
        src: int,
        src_nbytes: int,
        src_dtype: str,
        dst: torch.Tensor,
        dst_dtype: str,
        shape: Sequence[int],
        src_strides: Sequence[int],
        dst_strides: Sequence[int],
        src_offset: int = 0,
        dst_offset: int = 0,
        dst_nbytes: int | None = None,
    ) -> None:
        """Adds one op writing into ``dst`` (a CPU tensor); the write is bounded
        by ``dst_nbytes`` bytes from ``dst.data_ptr()`` (default: its numel)."""
        if len(shape) > _native.MAX_DIMS:
            raise ValueError(f"copy region has {len(shape)} dims; the engine supports {_native.MAX_DIMS}")
        pad = _native.MAX_DIMS - len(shape)
        self._rows.append(
            [
                file,
                src,
                src_nbytes,
                _native.DTYPE_CODES[src_dtype],
                dst.data_ptr(),
                dst.numel() * dst.element_size() if dst_nbytes is None else dst_nbytes,
                _native.DTYPE_CODES[dst_dtype],
                len(shape),
                src_offset,
                dst_offset,
                *[int(s) for s in shape],
                *([1] * pad),
                *[int(s) for s in src_strides],
                *([0] * pad),
                *[int(s) for s in dst_strides],
                *([0] * pad),
            ]
        )

    def execute(self, engine, files: Sequence) -> int:
        """Runs every op (GIL released); returns the source bytes read."""
        if not self._rows:
            return 0
        arr = np.ascontiguousarray(np.array(self._rows, dtype=np.int64))
        nbytes = engine.execute(list(files), arr.ctypes.data, arr.nbytes)
        self._rows.clear()
        return int(nbytes)
