"""Cold reads: a checkpoint that is not in the page cache, read at the disk's speed.

Reading a cold file through a memory map faults one page (or one readahead
window) at a time. ``ColdEngine`` stands in for the native ``CopyEngine``:
before a batch of copy ops runs, the byte spans its ops read from the files
are read with large preads into one read buffer (``O_DIRECT``: widened to
aligned bounds and laid out so that every read lands at its place in the
buffer), and the ops are rewritten to copy from that buffer.
Packing, fusion and casts are the engine's, unchanged. A buffered read of a
plain copy (same dtype, contiguous at both ends: a whole tensor, a row slice,
one expert of a fused stack) skips the buffer and lands in its destination.
The reads are buffered (each chunk's windows asked of the kernel up front with
``POSIX_FADV_WILLNEED``, no readahead beyond them) or ``O_DIRECT`` (several in
flight; with ``drop_cache``, or forced with the ``direct_io`` keyword; buffered
where the file system refuses it): see ``ColdEngine.read_buffered``.

Also here: page-cache residency (``mincore``), eviction (``POSIX_FADV_DONTNEED``)
and the disk's sequential read bandwidth, which ``read_mode="auto"`` and
``streamload bench --cold`` use.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..options import env_flag
from ..timeline import Timeline, current
from . import _native
from .copy_ops import ITEMSIZE
from .readahead import ReadAhead

READ_MODES = ("auto", "mmap", "pread", "cold")
# "auto" reads explicitly when less than this fraction of the files' pages is cached,
# judged on about RESIDENCY_SAMPLE pages per file (16 MiB of 4 KiB pages, in 64 KiB windows).
COLD_BELOW = 0.5
RESIDENCY_SAMPLE = 4096
ALIGN = _native.DIRECT_ALIGN
_F = _native.OP_FIELDS
_D = _native.MAX_DIMS
# Columns of an op row (csrc/copy_engine.h, CopyOp).
_FILE, _SRC, _SRC_NBYTES, _SRC_DTYPE, _DST, _DST_NBYTES, _DST_DTYPE = 0, 1, 2, 3, 4, 5, 6
_NDIM, _SRC_OFFSET, _DST_OFFSET = 7, 8, 9
_SHAPE, _SRC_STRIDE, _DST_STRIDE = 10, 10 + _D, 10 + 2 * _D


def residency(paths: Sequence[str | os.PathLike[str]], sample_pages: int = 0) -> float:
    """Fraction of the files' bytes in the page cache (1.0 for no bytes), each file weighed
    by its size: every page (``sample_pages=0``), or about ``sample_pages`` per file in windows
    spread evenly over it (mincore's cost then stays flat in the checkpoint's size).

    Example:
        >>> residency(ckpt.paths)  # 0.0 right after evict(ckpt.paths)
    """
    got = total = 0.0
    for p in paths:
        size = os.path.getsize(p)
        r, t = _native.residency(str(p), 0, 0, sample_pages)
        if t:
            got, total = got + size * r / t, total + size
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
    paths: Sequence[str | os.PathLike[str]],
    threads: int = 0,
    block_bytes: int = 16 << 20,
    direct: str = "auto",
) -> Bandwidth:
    """Reads every file once in large blocks, several in flight, into throwaway
    buffers: ``O_DIRECT`` where possible, else buffered after evicting the files
    (``direct="off"``: buffered; with ``threads=1``, one stream the kernel reads ahead of).

    Example:
        >>> probe_bandwidth(ckpt.paths).gbps
    """
    reader = _native.ColdReader(threads=threads, block_bytes=block_bytes, direct=direct)
    stats = reader.probe([str(p) for p in paths])
    return Bandwidth(int(stats["bytes_read"]), float(stats["seconds"]), stats["direct_windows"] > 0)


def choose_read_mode(mode: str, paths: Sequence[str | os.PathLike[str]]) -> str:
    """The read mode to use: ``"auto"`` becomes ``"cold"`` when less than
    ``COLD_BELOW`` of the files is in the page cache, else stays ``"auto"``
    (mapped, pread where mapping fails)."""
    if mode not in READ_MODES:
        raise ValueError(f"read_mode must be one of {READ_MODES}, not {mode!r}")
    if mode != "auto":
        return mode
    return "cold" if residency(paths, RESIDENCY_SAMPLE) < COLD_BELOW else "auto"


@dataclass
class ColdStats:
    """What the cold reads of one checkpoint did."""

    bytes_read: int = 0
    seconds: float = 0.0
    reads: int = 0
    direct_reads: int = 0
    direct_refused: bool = False
    in_place_bytes: int = 0  # source bytes read straight into their destinations (buffered)


class ColdEngine:
    """A ``CopyEngine`` whose file reads are explicit, large and aligned.

    A batch's file ops are cut (along their outer dims) into chunks of at most
    ``chunk_bytes`` of source spans, in file order; each chunk is read into one of
    ``buffers`` read buffers on a helper thread (GIL released, ``lanes`` chunks at
    once) while the engine copies earlier chunks out of memory; buffered, the plain
    copies among them are read straight into their destinations. A batch announced
    with ``expect`` (the next bucket) is read as soon as a buffer frees, so the
    disk keeps reading while this bucket is copied, scattered and agreed on.
    Memory: ``buffers`` buffers of about ``chunk_bytes`` (``peak_buffer_bytes``),
    whatever the number of batches, plus the reader's bounce buffers for reads it
    cannot land at their place in a buffer.

    Args:
        engine: the native CopyEngine that runs the rewritten ops.
        files: the checkpoint's opened files (``SafetensorsFile``), in file-index order.
        threads: O_DIRECT reads in flight, all lanes together (0: the native default); a buffered
            lane reads with one thread (the kernel reads all the windows it was asked for at once).
        block_bytes: bytes per read.
        chunk_bytes: source bytes per chunk (per read buffer).
        drop_cache: drop each window from the page cache once read.
        buffers: read buffers (>= 2).
        lanes: chunks read at once (a native read call waits for its slowest read;
            two keep the disk's queue full across chunk boundaries).
        in_place: buffered reads of plain copies (same dtype, contiguous source and
            destination, source bytes no other op of the chunk reads) land straight in
            their destinations, with no read buffer and no copy out of it; the copies that
            cast, slice columns or share source bytes go through the buffers. False: every
            read goes through the buffers (tests compare the two paths).
        direct_io: the load's keyword: None (not given: ``STREAMLOAD_DIRECT_IO=0/1`` if set,
            else buffered, O_DIRECT with ``drop_cache``), True (O_DIRECT where the file system
            allows it) or False (buffered, even with ``drop_cache``: dropped behind the reader).
    """

    def __init__(
        self,
        engine: Any,
        files: Sequence[Any],
        threads: int = 0,
        block_bytes: int = 4 << 20,
        chunk_bytes: int = 16 << 20,
        drop_cache: bool = False,
        buffers: int = 4,
        lanes: int = 2,
        in_place: bool = True,
        direct_io: bool | None = None,
    ) -> None:
        self.engine = engine
        self.paths = [f.path for f in files]
        # The files as opened (headers read from them): a path replaced since is an error.
        self.fds = [int(getattr(f, "fileno", -1)) for f in files]
        self.sizes = np.array([f.file_size for f in files], dtype=np.int64)
        self.data_starts = np.array([f.data_start for f in files], dtype=np.int64)
        # One reader per lane: a native read call waits for its slowest window, so chunks
        # are read by `lanes` calls at once (each on its own pool) to keep the disk's queue full.
        self._reader_args = (threads, block_bytes, drop_cache)
        self.drop_cache = drop_cache
        self.direct_io = env_flag("direct_io", direct_io)  # the one place its variable is read
        self._lanes: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.buffered = False
        self._lane_count = lanes
        self._set_lanes(self._policy(True))
        self._reader: Any = None  # for prefetch; made on first use (its threads cost a start-up)
        self._stats_lock = threading.Lock()
        self.peak_buffer_bytes = 0  # the most bytes the read buffers held at once
        self.chunk_bytes = chunk_bytes
        self.stats = ColdStats()
        self._timeline: Timeline = current()  # the load's, set per execute (reads run on a helper thread)
        self._buffers: list[torch.Tensor | None] = [None] * buffers
        self._ahead = ReadAhead(self._read_chunk, buffers, lanes, on_fork=self._reset_in_child)
        self._forked = False  # set in a fork child: the lane readers are made anew before the next read
        # Buffered reads land straight in the destinations of plain copies (see _in_place).
        self.lands_in_place = in_place
        self._itemsize = np.zeros(max(_native.DTYPE_CODES.values()) + 1, dtype=np.int64)
        for name, code in _native.DTYPE_CODES.items():
            # Sub-byte dtypes (F4, F6_*) have no whole item size: their ops stay on the files (0 here).
            self._itemsize[code] = ITEMSIZE.get(name, 0)

    def _set_lanes(self, buffered: bool) -> None:
        """Makes the lane readers: O_DIRECT (where the file system allows) on ``lanes``
        lanes, or buffered (one thread per lane)."""
        threads, block_bytes, drop_cache = self._reader_args
        while not self._lanes.empty():
            self._lanes.get()
        self.buffered = buffered
        # Buffered: each lane one thread that asks for its chunk's windows up front (WILLNEED)
        # and copies them out in file order; O_DIRECT: several reads in flight per lane.
        per_lane = 1 if buffered else max(1, (threads or 8) // self._lane_count)
        for _ in range(self._lane_count):
            self._lanes.put(
                _native.ColdReader(
                    threads=per_lane,
                    block_bytes=block_bytes,
                    direct="off" if buffered else "auto",
                    drop_behind=drop_cache,
                )
            )

    def _reset_in_child(self) -> None:
        """In a child of ``os.fork()`` (``ReadAhead.reset_in_child`` calls it): a lane reader
        a parent's helper thread held is lost with that thread, and a lock it held stays
        locked, so the lanes, the prefetch reader and the stats lock are made anew (the
        lanes before the child's next read, on its own thread: see ``_lanes_after_fork``)."""
        self._lanes = queue.SimpleQueue()
        self._reader = None
        self._stats_lock = threading.Lock()
        self._forked = True

    def _lanes_after_fork(self) -> None:
        if self._forked:
            self._forked = False
            self._set_lanes(self.buffered)

    def _policy(self, buffered: bool) -> bool:
        """``buffered`` after ``direct_io``: False forces buffered and True O_DIRECT (where
        the file system allows it); not given, reads with ``drop_cache`` stay O_DIRECT, which
        leaves no pages behind (a buffered reader that drops behind it must not let the
        kernel read ahead)."""
        if self.direct_io is not None:
            return not self.direct_io
        return buffered and not self._reader_args[2]

    def read_buffered(self, buffered: bool) -> None:
        """Chooses buffered reads (each chunk's windows asked of the kernel up front with
        ``POSIX_FADV_WILLNEED``, then copied out in file order) or O_DIRECT (several reads
        in flight per lane) for the loads to come, subject to the overrides of ``_policy``.

        A new engine reads buffered: on the disks measured (``streamload bench --cold``,
        README) the kernel's page cache served a cold checkpoint faster than O_DIRECT reads
        in every reader mode; ``direct_io=True`` is for disks where O_DIRECT wins (the bench
        prints both rates) or CPU is short.
        """
        buffered = self._policy(buffered)
        if buffered == self.buffered:
            return
        self._ahead.drain()  # no read in flight uses the old readers
        self._set_lanes(buffered)

    @property
    def lands_ahead(self) -> bool:
        """True when reads of an announced batch (``expect``) may land in its ops'
        destinations before it is executed (buffered reads of plain copies)."""
        return self.buffered and self.lands_in_place

    @property
    def threads(self) -> int:
        return int(self.engine.threads)

    def drain(self) -> None:
        """Waits for the reads in flight and drops every announced batch (after a failure)."""
        self._ahead.drain()

    def close(self) -> None:
        """Frees the read buffers and the helper thread (reads in flight are waited for)."""
        self._ahead.close()
        self._buffers = [None] * len(self._buffers)

    @property
    def reader(self) -> Any:
        """A native ColdReader over every thread (prefetch's)."""
        if self._reader is None:
            threads, block, drop = self._reader_args
            self._reader = _native.ColdReader(threads=threads, block_bytes=block, drop_behind=drop)
        return self._reader

    @property
    def buffer_bytes(self) -> int:
        """Bytes the read buffers hold now (at most ``buffers`` x about ``chunk_bytes``)."""
        return sum(b.numel() for b in self._buffers if b is not None)

    def _buffer(self, which: int, nbytes: int) -> int:
        """The aligned address of read buffer ``which``, grown to ``nbytes``."""
        buf = self._buffers[which]
        if buf is None or buf.numel() < nbytes + ALIGN:
            self._buffers[which] = None
            buf = self._buffers[which] = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        base = buf.data_ptr()
        return base + (-base) % ALIGN

    def _extents(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per op: first and last source element, and the source item size."""
        span = (rows[:, _SHAPE : _SHAPE + _D] - 1) * rows[:, _SRC_STRIDE : _SRC_STRIDE + _D]
        lo = rows[:, _SRC_OFFSET] + np.minimum(span, 0).sum(axis=1)
        hi = rows[:, _SRC_OFFSET] + np.maximum(span, 0).sum(axis=1)
        return lo, hi, self._itemsize[rows[:, _SRC_DTYPE]]

    def _pieces(self, row: np.ndarray) -> list[np.ndarray]:
        """``row`` cut along its outer dims until each piece's source span fits a chunk."""
        lo, hi, isz = (int(x[0]) for x in self._extents(row[None]))
        if (hi - lo + 1) * isz <= self.chunk_bytes:
            return [row]
        ndim = int(row[_NDIM])
        dims = [d for d in range(ndim) if row[_SHAPE + d] > 1 and row[_SRC_STRIDE + d] != 0]
        if not dims:
            return [row]
        # Cut along the dim that spans the most source bytes (a transposed source's outer
        # dim may have stride 1); a cut that would not shrink the row ends the recursion.
        d = max(dims, key=lambda k: abs(int(row[_SRC_STRIDE + k])) * (int(row[_SHAPE + k]) - 1))
        n, ss, ds = int(row[_SHAPE + d]), int(row[_SRC_STRIDE + d]), int(row[_DST_STRIDE + d])
        step = max(1, self.chunk_bytes // (abs(ss) * isz))
        if step >= n:
            return [row]
        out: list[np.ndarray] = []
        for k in range(0, n, step):
            piece = row.copy()
            piece[_SHAPE + d] = min(step, n - k)
            piece[_SRC_OFFSET] += k * ss
            piece[_DST_OFFSET] += k * ds
            out.extend(self._pieces(piece))
        return out

    def _in_place(self, rows: np.ndarray, a: np.ndarray, b: np.ndarray, isz: np.ndarray) -> np.ndarray:
        """Which ops a buffered read may land straight in their destination: a contiguous
        source span copied unchanged (same dtype) to a contiguous destination span within
        its bounds, whose source bytes no other op of the chunk reads (those share the read
        buffer). The rest are copied out of the read buffer by the engine."""
        used = np.arange(_D)[None, :] < rows[:, _NDIM][:, None]
        shape = np.where(used, rows[:, _SHAPE : _SHAPE + _D], 1)
        # Contiguous strides: the product of the inner dims' sizes.
        inner = np.ones_like(shape)
        inner[:, :-1] = np.cumprod(shape[:, :0:-1], axis=1)[:, ::-1]
        free = shape == 1  # a dim of one element (or past ndim) has no stride that matters
        plain = (free | (rows[:, _SRC_STRIDE : _SRC_STRIDE + _D] == inner)).all(axis=1)
        plain &= (free | (rows[:, _DST_STRIDE : _DST_STRIDE + _D] == inner)).all(axis=1)
        plain &= rows[:, _SRC_DTYPE] == rows[:, _DST_DTYPE]
        nbytes = shape.prod(axis=1) * isz
        first = rows[:, _DST_OFFSET] * isz
        plain &= (rows[:, _DST] != 0) & (first >= 0) & (first + nbytes <= rows[:, _DST_NBYTES])
        plain &= b - a == nbytes
        # Alone: no other op's source span overlaps it (each file on its own stretch of one line).
        shift = rows[:, _FILE] * (int(self.sizes.max()) + 1)
        order = np.argsort(a + shift, kind="stable")
        sa, sb = (a + shift)[order], (b + shift)[order]
        reach = np.maximum.accumulate(sb)
        alone = np.ones(len(rows), dtype=bool)
        alone[1:] &= sa[1:] >= reach[:-1]  # nothing before it reaches into it
        alone[:-1] &= sb[:-1] <= sa[1:]  # nothing after it starts inside it
        out = np.zeros(len(rows), dtype=bool)
        out[order] = alone
        return plain & out

    def _read_chunk(self, rows: np.ndarray, which: int) -> tuple[np.ndarray, int]:
        """Reads the spans of ``rows`` (file ops, in bounds): buffered, the ops ``_in_place``
        picks straight into their destinations, the rest into buffer ``which``. Returns the
        rest rewritten to copy from the buffer, and the source bytes read in place."""
        lo, hi, isz = self._extents(rows)
        fidx = rows[:, _FILE]
        a = self.data_starts[fidx] + rows[:, _SRC] + lo * isz  # absolute file offsets
        b = self.data_starts[fidx] + rows[:, _SRC] + (hi + 1) * isz
        own = (
            self._in_place(rows, a, b, isz)
            if self.buffered and self.lands_in_place
            else np.zeros(len(rows), dtype=bool)
        )
        # The other ops' spans per file, merged, laid out aligned in the buffer (O_DIRECT: the
        # spans aligned too, so that every read lands at its place in the buffer).
        # Per file: its spans, the ops read through the buffer, the ops landing in place.
        plan: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        total = 0
        for f in np.unique(fidx):
            m = np.nonzero((fidx == f) & ~own)[0]
            sa = a[m] if self.buffered else (a[m] // ALIGN) * ALIGN
            sb = b[m] if self.buffered else np.minimum(-(-b[m] // ALIGN) * ALIGN, self.sizes[f])
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
            pos = total + np.concatenate([[0], np.cumsum(room)[:-1]]).astype(np.int64)
            total += int(room.sum())
            landed = np.nonzero((fidx == f) & own)[0]
            plan.append((int(f), np.stack([st, en - st, pos[: len(st)], room], axis=1), m, landed))
        base = self._buffer(which, total) if total else 0
        with self._stats_lock:
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        where = np.zeros(len(rows), dtype=np.int64)
        dst = rows[:, _DST] + rows[:, _DST_OFFSET] * isz
        for f, spans, m, o in plan:
            k = np.searchsorted(spans[:, 0], a[m], side="right") - 1
            where[m] = base + spans[k, 2] + (a[m] - spans[k, 0])
            buffered = np.stack([spans[:, 0], spans[:, 1], base + spans[:, 2], spans[:, 3]], axis=1)
            # A landed read may write its own bytes and no more (the bytes after them are other
            # ops' destinations); _in_place checked that they fit the destination.
            landed = np.stack([a[o], b[o] - a[o], dst[o], b[o] - a[o]], axis=1)
            ranges = np.concatenate([buffered, landed])
            ranges = np.ascontiguousarray(ranges[np.argsort(ranges[:, 0], kind="stable")])
            reader = self._lanes.get()
            try:
                s = reader.read(self.paths[f], ranges.ctypes.data, ranges.nbytes, self.fds[f])
            finally:
                self._lanes.put(reader)
            self._timeline.add("cold_read", float(s["seconds"]))
            self._timeline.count("disk_bytes", int(s["bytes_read"]))
            self._timeline.count("disk_reads", int(s["windows"]))
            with self._stats_lock:
                self.stats.bytes_read += int(s["bytes_read"])
                self.stats.seconds += float(s["seconds"])
                self.stats.reads += int(s["windows"])
                self.stats.direct_reads += int(s["direct_windows"])
                self.stats.direct_refused |= bool(s["direct_refused"])
                self.stats.in_place_bytes += int((b[o] - a[o]).sum())
        rest = rows[~own].copy()
        rest[:, _FILE] = -1
        rest[:, _SRC] = where[~own]
        rest[:, _SRC_NBYTES] = ((hi - lo + 1) * isz)[~own]
        rest[:, _SRC_OFFSET] -= lo[~own]
        return np.ascontiguousarray(rest), int((b[own] - a[own]).sum())

    def prefetch(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        """Reads (file index, absolute offset, bytes) ranges into the page cache at
        the disk's speed (large buffered reads, several in flight): for shards that
        are views of the mapped files, which then fault nothing in from disk."""
        by_file: dict[int, list[tuple[int, int]]] = {}
        for index, offset, nbytes in ranges:
            by_file.setdefault(index, []).append((offset, nbytes))
        for index, spans in sorted(by_file.items()):
            arr = np.ascontiguousarray(np.array(sorted(spans), dtype=np.int64).reshape(-1, 2))
            s = self.reader.prefetch(self.paths[index], arr.ctypes.data, arr.nbytes)
            current().count("disk_bytes", int(s["bytes_read"]))
            current().count("disk_reads", int(s["windows"]))
            self.stats.bytes_read += int(s["bytes_read"])
            self.stats.seconds += float(s["seconds"])
            self.stats.reads += int(s["windows"])

    def _run(self, files: Sequence[Any], rows: np.ndarray) -> int:
        if len(rows) == 0:
            return 0
        rows = np.ascontiguousarray(rows)
        return int(self.engine.execute(list(files), rows.ctypes.data, rows.nbytes))

    def _split(self, ops: int, ops_nbytes: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The batch's op rows and which of them read the files in bounds (the cold ones);
        None for a batch that is not whole op rows (the native engine reports it)."""
        n = ops_nbytes // (8 * _F)
        if n == 0 or ops_nbytes % (8 * _F):
            return None
        rows = np.ctypeslib.as_array((ctypes.c_int64 * (n * _F)).from_address(ops)).reshape(n, _F).copy()
        fidx = rows[:, _FILE]
        cold = (fidx >= 0) & (fidx < len(self.paths)) & (rows[:, _SHAPE : _SHAPE + _D].prod(axis=1) > 0)
        cold &= (rows[:, _SRC_DTYPE] >= 0) & (rows[:, _SRC_DTYPE] < len(self._itemsize))
        cold &= self._itemsize[np.clip(rows[:, _SRC_DTYPE], 0, len(self._itemsize) - 1)] > 0
        cold &= (
            (rows[:, _NDIM] >= 0) & (rows[:, _NDIM] <= _D) & (rows[:, _SHAPE : _SHAPE + _D] >= 0).all(axis=1)
        )
        lo, hi, isz = self._extents(rows)
        f = np.clip(fidx, 0, max(len(self.paths) - 1, 0))
        end = self.data_starts[f] + rows[:, _SRC] + (hi + 1) * isz
        # Ops out of bounds (the engine's to report) and ops from memory run first, as they are:
        # a bad batch then fails before any chunk is copied out (an announced batch's reads
        # may have landed already; the load fails all the same and drains them).
        cold &= (
            (lo >= 0)
            & ((hi + 1) * isz <= rows[:, _SRC_NBYTES])
            & (rows[:, _SRC] >= 0)
            & (end <= self.sizes[f])
        )
        return rows, cold

    def _chunks(self, rows: np.ndarray) -> list[np.ndarray]:
        """The cold ops cut into pieces and grouped, in file order, into chunks of at
        most ``chunk_bytes`` of source spans (one read buffer each)."""
        lo, hi, isz = self._extents(rows)
        big = (hi - lo + 1) * isz > self.chunk_bytes
        # Only ops over a chunk are cut (one by one); the rest go as they are, vectorised.
        cut = (
            rows
            if not big.any()
            else np.concatenate([rows[~big], *(np.stack(self._pieces(r)) for r in rows[big])])
        )
        plo, phi, pisz = self._extents(cut)
        start = self.data_starts[cut[:, _FILE]] + cut[:, _SRC] + plo * pisz
        order = np.lexsort((start, cut[:, _FILE]))  # file order: the disk reads front to back
        chunks: list[np.ndarray] = []
        acc, first = 0, 0
        for i, n in enumerate(((phi - plo + 1) * pisz)[order].tolist()):
            if i > first and acc + n > self.chunk_bytes:
                chunks.append(cut[order[first:i]])
                first, acc = i, 0
            acc += n
        chunks.append(cut[order[first:]])
        return chunks

    def expect(self, ops: int, ops_nbytes: int, tag: int = -1) -> None:
        """Announces the ops of the next ``execute`` call: their reads are issued as soon
        as a read buffer frees up (while this batch is still copied or scattered), so the
        disk never waits for the pipeline. Their destinations must be free from now on:
        buffered reads of plain copies land there directly. A later ``execute`` with other ops drops the
        announcement (its reads are waited for, never copied from). ``tag``: the bucket
        the ops pack, which the timeline's read events name.

        Example:
            >>> engine.expect(next_ops.ctypes.data, next_ops.nbytes)  # bucket k+1
            >>> engine.execute(files, ops.ctypes.data, ops.nbytes)  # bucket k
        """
        self._lanes_after_fork()
        split = self._split(ops, ops_nbytes)
        if split is None or not split[1].any():
            return
        rows, cold_ = split
        self._timeline = self._ahead.timeline = current()
        self._ahead.announce(rows, self._chunks(rows[cold_]), tag)

    def execute(self, files: Sequence[Any], ops: int, ops_nbytes: int) -> int:
        """Reads the spans the ops need, chunk by chunk, and runs the ops from
        memory; returns the source bytes read (as ``CopyEngine.execute``)."""
        self._lanes_after_fork()
        split = self._split(ops, ops_nbytes)
        if split is None:
            return int(self.engine.execute(list(files), ops, ops_nbytes))
        rows, cold_ = split
        tl = self._timeline = self._ahead.timeline = current()
        ahead = self._ahead
        try:
            done = self._run(files, rows[~cold_])
            if not cold_.any():
                return done
            chunks = self._chunks(rows[cold_]) if not ahead.announced(rows) else []
            batch = ahead.start(rows, chunks, tl.bucket)
            for i in range(len(batch.chunks)):
                with tl.span("cold_wait", tl.bucket):
                    ready, landed = ahead.wait(batch, i)
                with tl.span("cold_copy", tl.bucket):
                    done += landed + self._run(files, ready)
                ahead.done(batch, i)
        except BaseException:
            ahead.drain()  # no read may still be writing into a buffer, none is kept
            raise
        return done
