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
    "F8_E8M0": torch.float8_e8m0fnu,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
}
# Sub-byte dtypes (F4, F6_E2M3, F6_E3M2) parse and copy as bytes natively but
# have no torch element type of the same unit, so they are not listed here.
ST_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
FLOAT_FAMILY = frozenset({"F16", "BF16", "F32", "F64"})
# fp8 formats the engine widens exactly as torch's casts do.
FP8_WIDENING = frozenset({"F8_E4M3", "F8_E5M2"})
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in TORCH_DTYPES.items()}


_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits, flat, as integers of its width: ``torch.equal`` on two of them is bit equality.

    Example:
        >>> torch.equal(bit_view(a), bit_view(b))  # NaN payloads and -0.0 included
    """
    t = t.detach().contiguous().reshape(-1)
    return t.view(_SAME_WIDTH_INTS[t.element_size()])


def worker_threads() -> int:
    """The native engine's default worker count (the machine's usable cores).

    Returns:
        The thread count a Checkpoint uses when given none.

    Example:
        >>> worker_threads() >= 1
        True
    """
    return int(_native.default_threads())


def can_convert(src: str, dst: str) -> bool:
    """True when the native engine casts ``src`` to ``dst`` exactly as torch does:
    the same type (bytes), between floating types, or widening fp8 to them."""
    return src == dst or (dst in FLOAT_FAMILY and (src in FLOAT_FAMILY or src in FP8_WIDENING))


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
        self._dequant: list[list[int]] = []

    def __len__(self) -> int:
        return len(self._rows) + len(self._dequant)

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

    def add_dequant(
        self,
        *,
        kind: str,
        weight: tuple[int, int, int, str],
        scale: tuple[int, int, int, str],
        dst: torch.Tensor,
        dst_dtype: str,
        dims: Sequence[int],
        block: Sequence[int],
        box: Sequence[tuple[int, int]],
        dst_offset: int,
        dst_strides: Sequence[int],
        dst_nbytes: int | None = None,
    ) -> None:
        """Adds one dequantizing op (see ``csrc/dequant.h``): ``box`` of the
        logical [batch, rows, cols] values of a quantized tensor, scaled, into ``dst``.

        Args:
            kind: ``"fp8_block"`` or ``"mxfp4"``.
            weight, scale: (file index or -1, offset in the data section or
                address, byte length, dtype name) of the two source tensors.
            dims: logical (batch, rows, cols); block: values per scale (rows, cols).
            box: (start, size) per logical dim; dst_offset/dst_strides: where
                box[0, 0, 0] lands and the element strides of the three dims.
        """
        self._dequant.append(
            [
                _native.DEQUANT_KINDS[kind],
                weight[0], weight[1], weight[2], _native.DTYPE_CODES[weight[3]],
                scale[0], scale[1], scale[2], _native.DTYPE_CODES[scale[3]],
                dst.data_ptr(),
                dst.numel() * dst.element_size() if dst_nbytes is None else dst_nbytes,
                _native.DTYPE_CODES[dst_dtype],
                *[int(d) for d in dims],
                *[int(b) for b in block],
                *[int(v) for start_size in box for v in start_size],
                dst_offset,
                *[int(s) for s in dst_strides],
            ]
        )  # fmt: skip

    def copy_rows(self) -> np.ndarray:
        """The copy ops as one C-contiguous int64 array (what ``execute`` hands the engine)."""
        return np.ascontiguousarray(np.array(self._rows, dtype=np.int64).reshape(-1, _native.OP_FIELDS))

    @property
    def dequantizing(self) -> bool:
        """True when the batch holds dequantizing ops."""
        return bool(self._dequant)

    def execute(self, engine, files: Sequence) -> int:
        """Runs every op (GIL released); returns the source bytes read."""
        nbytes = 0
        if self._rows:
            arr = np.ascontiguousarray(np.array(self._rows, dtype=np.int64))
            nbytes += engine.execute(list(files), arr.ctypes.data, arr.nbytes)
            self._rows.clear()
        if self._dequant:
            arr = np.ascontiguousarray(np.array(self._dequant, dtype=np.int64))
            local = getattr(engine, "dequantize", None)  # an engine whose files are not on disk
            if local is not None:
                nbytes += local(arr)
            else:
                # Dequantizing ops read through the files themselves (mapped or pread): a cold
                # engine wraps the native one, which they need.
                native = getattr(engine, "engine", engine)
                nbytes += _native.dequantize(native, list(files), arr.ctypes.data, arr.nbytes)
            self._dequant.clear()
        return int(nbytes)
