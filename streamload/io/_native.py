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
# Cold reads (csrc/cold_reader.h): explicit aligned preads, residency, eviction.
ColdReader = _ext.ColdReader
residency = _ext.residency
evict = _ext.evict
DIRECT_ALIGN: int = _ext.DIRECT_ALIGN
RANGE_FIELDS: int = _ext.RANGE_FIELDS


__all__ = [
    "DEQUANT_FIELDS",
    "DEQUANT_KINDS",
    "DIRECT_ALIGN",
    "DTYPE_CODES",
    "MAX_DIMS",
    "OP_FIELDS",
    "RANGE_FIELDS",
    "ColdReader",
    "CopyEngine",
    "SafetensorsFile",
    "default_threads",
    "dequantize",
    "evict",
    "parse_header",
    "residency",
]
