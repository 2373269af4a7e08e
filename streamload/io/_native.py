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
# Cold reads (csrc/cold_reader.h): explicit aligned preads, residency, eviction.
ColdReader = _ext.ColdReader
residency = _ext.residency
evict = _ext.evict
DIRECT_ALIGN: int = _ext.DIRECT_ALIGN
RANGE_FIELDS: int = _ext.RANGE_FIELDS


def cuda_module():
    """Returns the optional CUDA extension, or None where it was not built."""
    try:
        from .. import _streamload_cuda  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _streamload_cuda


__all__ = [
    "DIRECT_ALIGN",
    "DTYPE_CODES",
    "MAX_DIMS",
    "OP_FIELDS",
    "RANGE_FIELDS",
    "ColdReader",
    "CopyEngine",
    "SafetensorsFile",
    "cuda_module",
    "default_threads",
    "evict",
    "parse_header",
    "residency",
]
