"""Cold reads: a checkpoint that is not in the page cache, read at the disk's speed.

Reading a cold file through a memory map faults one page (or one readahead
window) at a time. ``ColdEngine`` stands in for the native ``CopyEngine``:
before a batch of copy ops runs, the byte spans its ops read from the files
are read with large aligned preads (several in flight, ``O_DIRECT`` where the
file system allows it, buffered where it refuses) into one read buffer, laid
out so that every read lands in place, and the ops are rewritten to copy from
that buffer. Packing, fusion and casts are the engine's, unchanged.

Also here: page-cache residency (``mincore``), eviction (``POSIX_FADV_DONTNEED``)
and the disk's sequential read bandwidth, which ``read_mode="auto"`` and
``streamload bench --cold`` use.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import _native
from .copy_ops import TORCH_DTYPES

READ_MODES = ("auto", "mmap", "pread", "cold")
# "auto" reads explicitly when less than this fraction of the files' pages is cached.
COLD_BELOW = 0.5
ALIGN = _native.DIRECT_ALIGN
_F = _native.OP_FIELDS
_D = _native.MAX_DIMS
# Columns of an op row (csrc/copy_engine.h, CopyOp).
_FILE, _SRC, _SRC_NBYTES, _SRC_DTYPE, _NDIM, _SRC_OFFSET = 0, 1, 2, 3, 7, 8
_SHAPE, _SRC_STRIDE = 10, 10 + _D


def residency(paths: Sequence[str | os.PathLike[str]]) -> float:
    """Fraction of the files' pages in the page cache (1.0 for no bytes).

    Example:
        >>> residency(ckpt.paths)  # 0.0 right after evict(ckpt.paths)
    """
    got = total = 0
    for p in paths:
        r, t = _native.residency(str(p))
        got, total = got + r, total + t
    return got / total if total else 1.0


def evict(paths: Sequence[str | os.PathLike[str]]) -> None:
    """Drops the files from the page cache (dirty pages are written back first)."""
    for p in paths:
        _native.evict(str(p))


@dataclass
class Bandwidth:
    """The disk's sequential read bandwidth, measured by reading files once."""

    bytes: int
    seconds: float
    direct: bool  # O_DIRECT (else buffered reads of evicted files)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def probe_bandwidth(
    paths: Sequence[str | os.PathLike[str]], threads: int = 0, block_bytes: int = 16 << 20
) -> Bandwidth:
    """Reads every file once in large blocks, several in flight, into throwaway
    buffers: ``O_DIRECT`` where possible, else buffered after evicting the files.

    Example:
        >>> probe_bandwidth(ckpt.paths).gbps
    """
    stats = _native.ColdReader(threads=threads, block_bytes=block_bytes).probe([str(p) for p in paths])
    return Bandwidth(int(stats["bytes_read"]), float(stats["seconds"]), stats["direct_windows"] > 0)


def choose_read_mode(mode: str, paths: Sequence[str | os.PathLike[str]]) -> str:
    """The read mode to use: ``"auto"`` becomes ``"cold"`` when less than
    ``COLD_BELOW`` of the files is in the page cache, else stays ``"auto"``
    (mapped, pread where mapping fails)."""
    if mode not in READ_MODES:
        raise ValueError(f"read_mode must be one of {READ_MODES}, not {mode!r}")
    if mode != "auto":
        return mode
    return "cold" if residency(paths) < COLD_BELOW else "auto"


@dataclass
class ColdStats:
    """What the cold reads of one checkpoint did."""

    bytes_read: int = 0
    seconds: float = 0.0
    reads: int = 0
    direct_reads: int = 0
    direct_refused: bool = False


class ColdEngine:
    """A ``CopyEngine`` whose file reads are explicit, large and aligned.

    Args:
        engine: the native CopyEngine that runs the rewritten ops.
        files: the checkpoint's opened files (``SafetensorsFile``), in file-index order.
        threads: reads in flight per file (0: the native default).
        block_bytes: bytes per read.
        drop_cache: drop each window from the page cache once read.
    """

    def __init__(
        self,
        engine: Any,
        files: Sequence[Any],
        threads: int = 0,
        block_bytes: int = 8 << 20,
        drop_cache: bool = False,
    ) -> None:
        self.engine = engine
        self.paths = [f.path for f in files]
        self.sizes = np.array([f.file_size for f in files], dtype=np.int64)
        self.data_starts = np.array([f.data_start for f in files], dtype=np.int64)
        self.reader = _native.ColdReader(threads=threads, block_bytes=block_bytes, drop_behind=drop_cache)
        self.stats = ColdStats()
        self._buffer: torch.Tensor | None = None
        self._itemsize = np.zeros(max(_native.DTYPE_CODES.values()) + 1, dtype=np.int64)
        for name, code in _native.DTYPE_CODES.items():
            self._itemsize[code] = torch.empty((), dtype=TORCH_DTYPES[name]).element_size()

    @property
    def threads(self) -> int:
        return int(self.engine.threads)

    def release(self) -> None:
        """Frees the read buffer (it is grown to the largest batch's spans)."""
        self._buffer = None

    def _buffer_at_least(self, nbytes: int) -> int:
        """The aligned address of a read buffer of at least ``nbytes``."""
        if self._buffer is None or self._buffer.numel() < nbytes + ALIGN:
            self._buffer = None
            self._buffer = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        base = self._buffer.data_ptr()
        return base + (-base) % ALIGN

    def execute(self, files: Sequence[Any], ops: int, ops_nbytes: int) -> int:
        """Reads the spans the ops need, then runs them from memory; returns the
        source bytes the ops read (as ``CopyEngine.execute``)."""
        n = ops_nbytes // (8 * _F)
        if n == 0 or ops_nbytes % (8 * _F):
            return int(self.engine.execute(list(files), ops, ops_nbytes))
        rows = np.ctypeslib.as_array((ctypes.c_int64 * (n * _F)).from_address(ops)).reshape(n, _F).copy()
        shape = rows[:, _SHAPE : _SHAPE + _D]
        # Ops with no elements or from memory stay as they are; the engine validates them.
        sel = np.nonzero((rows[:, _FILE] >= 0) & (shape.prod(axis=1) > 0))[0]
        if len(sel) == 0:
            return int(self.engine.execute(list(files), ops, ops_nbytes))
        sub = rows[sel]
        if (sub[:, _FILE] >= len(self.paths)).any() or (sub[:, _SRC_DTYPE] >= len(self._itemsize)).any():
            return int(self.engine.execute(list(files), ops, ops_nbytes))  # the engine raises the error
        span = (sub[:, _SHAPE : _SHAPE + _D] - 1) * sub[:, _SRC_STRIDE : _SRC_STRIDE + _D]
        lo = sub[:, _SRC_OFFSET] + np.minimum(span, 0).sum(axis=1)
        hi = sub[:, _SRC_OFFSET] + np.maximum(span, 0).sum(axis=1)
        isz = self._itemsize[sub[:, _SRC_DTYPE]]
        fidx = sub[:, _FILE]
        a = self.data_starts[fidx] + sub[:, _SRC] + lo * isz  # absolute file offsets
        b = self.data_starts[fidx] + sub[:, _SRC] + (hi + 1) * isz
        # Out-of-bounds regions are the engine's to report: leave those ops alone.
        ok = (lo >= 0) & ((hi + 1) * isz <= sub[:, _SRC_NBYTES]) & (b <= self.sizes[fidx])
        sel, sub, lo, hi, isz, fidx, a, b = sel[ok], sub[ok], lo[ok], hi[ok], isz[ok], fidx[ok], a[ok], b[ok]
        # Aligned spans per file, merged, laid out aligned: every read lands in place.
        plan: list[tuple[int, np.ndarray, np.ndarray]] = []
        total = 0
        for f in np.unique(fidx):
            m = fidx == f
            sa = (a[m] // ALIGN) * ALIGN
            sb = np.minimum(-(-b[m] // ALIGN) * ALIGN, self.sizes[f])
            order = np.argsort(sa, kind="stable")
            starts: list[int] = []
            ends: list[int] = []
            for s, e in zip(sa[order].tolist(), sb[order].tolist(), strict=True):
                if starts and s <= ends[-1]:
                    ends[-1] = max(ends[-1], e)
                else:
                    starts.append(s)
                    ends.append(e)
            st, en = np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
            room = -(-(en - st) // ALIGN) * ALIGN
            pos = total + np.concatenate([[0], np.cumsum(room)[:-1]])
            total += int(room.sum())
            plan.append((int(f), st, np.stack([en - st, pos, room], axis=1)))
        base = self._buffer_at_least(total)
        where = np.empty(len(sel), dtype=np.int64)
        for f, st, info in plan:
            m = np.nonzero(fidx == f)[0]
            k = np.searchsorted(st, a[m], side="right") - 1
            where[m] = base + info[k, 1] + (a[m] - st[k])
            ranges = np.stack([st, info[:, 0], base + info[:, 1], info[:, 2]], axis=1).astype(np.int64)
            ranges = np.ascontiguousarray(ranges)
            s = self.reader.read(self.paths[f], ranges.ctypes.data, ranges.nbytes)
            self.stats.bytes_read += int(s["bytes_read"])
            self.stats.seconds += float(s["seconds"])
            self.stats.reads += int(s["windows"])
            self.stats.direct_reads += int(s["direct_windows"])
            self.stats.direct_refused |= bool(s["direct_refused"])
        rows[sel, _FILE] = -1
        rows[sel, _SRC] = where
        rows[sel, _SRC_NBYTES] = (hi - lo + 1) * isz
        rows[sel, _SRC_OFFSET] -= lo
        rows = np.ascontiguousarray(rows)
        done = int(self.engine.execute(list(files), rows.ctypes.data, rows.nbytes))
        return done
