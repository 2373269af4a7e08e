"""The only module that imports the compiled extension."""

from __future__ import annotations

from .. import _streamload as _ext  # type: ignore[attr-defined]

SafetensorsFile = _ext.SafetensorsFile
CopyEngine = _ext.CopyEngine
parse_header = _ext.parse_header
default_threads = _ext.default_threads
OP_FIELDS: int = _ext.OP_FIELDS
MAX_DIMS: int = _ext.MAX_DIMS
DTYPE_CODES: dict[str, int] = dict(_ext.DTYPE_CODES)
dequantize = _ext.dequantize
DEQUANT_FIELDS: int = _ext.DEQUANT_FIELDS
DEQUANT_KINDS: dict[str, int] = dict(_ext.DEQUANT_KINDS)


__all__ = [
    "DEQUANT_FIELDS",
    "DEQUANT_KINDS",
    "DTYPE_CODES",
    "MAX_DIMS",
    "OP_FIELDS",
    "CopyEngine",
    "SafetensorsFile",
    "default_threads",
    "dequantize",
    "parse_header",
]
