"""The copy engine of a remote checkpoint: ``ColdEngine`` whose lanes read by ranged GETs.

The stream fetches the byte spans each bucket packs straight into the staging ring: a
bucket's spans are cut into chunks, each chunk's spans coalesced into requests
(``plan_requests``) and fetched by a ``RemoteReader`` per lane; gaps between them that a
later bucket reads ride along and are held until read (``GapCache``, announced by
``will_read``). Dequantizing ops fetch only the rows their boxes cover, then run the native
kernel from memory (``RemoteEngine.dequantize``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError
from . import _native
from .cold import ColdEngine
from .gap_cache import GapCache, union
from .remote_fetch import GAP_BYTES, Fetcher, RemoteReader

if TYPE_CHECKING:
    from .remote import RemoteFile

DEFAULT_GAP_CACHE_BYTES = 128 << 20  # bytes fetched ahead for later reads, held at most (GapCache)
# Columns of a dequantizing op row (``OpBatch.add_dequant``): weight and scale
# (file, offset, bytes, dtype), the logical dims, and the box's (start, size) per dim.
_DQ_WEIGHT, _DQ_SCALE, _DQ_DIMS, _DQ_BLOCK, _DQ_BOX = 1, 5, 12, 15, 17


class RemoteEngine(ColdEngine):
    """``ColdEngine`` whose lanes fetch by ranged GETs: a bucket's spans are cut into chunks
    (``chunk_bytes`` each, ``buffers`` in memory), each chunk's spans coalesced into requests
    (``plan_requests``) with up to ``concurrency`` in flight; plain copies land straight in
    their destinations (the staging ring or the shard), the rest in a read buffer. The next
    bucket's chunks are fetched while this one is scattered (``expect``)."""

    def __init__(self, engine: Any, files: Sequence[RemoteFile], fetcher: Fetcher) -> None:
        self.fetcher = fetcher
        self.keys = {f.path: (f.key, f.etag) for f in files}
        self.cache: GapCache | None = None  # set by will_read, for one load
        self.cache_budget = fetcher.remote.setting("gap_cache_bytes", DEFAULT_GAP_CACHE_BYTES)
        super().__init__(engine, files, chunk_bytes=64 << 20, buffers=4, lanes=2, direct_io=False)

    def _set_lanes(self, buffered: bool) -> None:
        while not self._lanes.empty():
            self._lanes.get()
        self.buffered = True  # no alignment: a request asks for exactly its bytes
        for _ in range(self._lane_count):
            self._lanes.put(RemoteReader(self.fetcher, self.keys, lambda: self.cache))

    def will_read(self, spans: Mapping[int, Iterable[tuple[int, int]]]) -> None:
        """Announces every span the load reads: (start, end) in each file's data section, by
        file index. Gaps between one read's requests made of bytes a later read wants are then
        fetched along and held (``GapCache``, at most ``storage_options["gap_cache_bytes"]``)
        until that read; ``drain`` (the load's end) lets them go. Every load announces (none:
        an empty ``spans``), so no load fetches ahead for another's plan."""
        wanted = {
            self.paths[f]: [(int(self.data_starts[f]) + a, int(self.data_starts[f]) + b) for a, b in ranges]
            for f, ranges in spans.items()
        }
        self.cache = GapCache(wanted, self.cache_budget, GAP_BYTES) if self.fetches_ahead and wanted else None

    @property
    def fetches_ahead(self) -> bool:
        """True when gaps may be fetched ahead (``gap_cache_bytes`` > 0): ``will_read`` wants spans."""
        return self.cache_budget > 0

    @property
    def buffer_bytes(self) -> int:
        held = self.cache.bytes_held if self.cache is not None else 0
        return super().buffer_bytes + held

    def drain(self) -> None:
        super().drain()
        self.cache = None

    def _reset_in_child(self) -> None:
        super()._reset_in_child()
        self.cache = None  # its lock and the claims in flight were the parent's

    def _policy(self, buffered: bool) -> bool:
        return True

    def _run(self, files: Sequence[Any], rows: np.ndarray) -> int:
        # Rewritten rows copy from memory; a row still naming a file is out of bounds, which the
        # native engine reports (it gets no files to read).
        return super()._run([], rows)

    def prefetch(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        raise CheckpointError("objects in a store are never mapped: there is nothing to prefetch")

    def dequantize(self, rows: np.ndarray) -> int:
        """Runs dequantizing ops (``OpBatch.add_dequant`` rows) whose sources are in the store.

        Of each quantized tensor, only the rows the ops' boxes cover are fetched (weight rows,
        and the scale rows of their blocks; a scale whose layout is not the plain block grid is
        fetched whole), each byte once however many ops share it, every file's requests in
        flight together, into memory the size of the tensor (pages never written are never
        backed); then the native kernel runs from memory. Returns the source bytes fetched."""
        self._lanes_after_fork()
        want: dict[tuple[int, int], tuple[int, list[tuple[int, int]]]] = {}  # (file, offset) -> bytes, ranges
        for row in rows:
            batch, nrows, ncols = (int(v) for v in row[_DQ_DIMS : _DQ_DIMS + 3])
            br, bc = (max(1, int(v)) for v in row[_DQ_BLOCK : _DQ_BLOCK + 2])
            (b0, nb), (r0, nr) = (
                (int(v) for v in row[_DQ_BOX : _DQ_BOX + 2]),
                (int(v) for v in row[_DQ_BOX + 2 : _DQ_BOX + 4]),
            )
            srows = -(-nrows // br)
            parts = (
                # (column, rows per batch, first row, rows, bytes per row when the layout is known)
                (_DQ_WEIGHT, nrows, r0, nr, None),
                (_DQ_SCALE, srows, r0 // br, (r0 + nr - 1) // br - r0 // br + 1, srows * -(-ncols // bc)),
            )
            for col, per_batch, first, count, grid in parts:
                f, off, nbytes, code = (int(v) for v in row[col : col + 4])
                if f < 0 or nr <= 0 or nb <= 0:
                    continue
                unit = nbytes // max(1, batch * per_batch)
                known = unit * batch * per_batch == nbytes
                if grid is not None:  # a scale: its element count must be the block grid's
                    known &= nbytes == batch * grid * int(self._itemsize[code]) and self._itemsize[code] > 0
                ranges = (
                    [
                        ((b * per_batch + first) * unit, (b * per_batch + first + count) * unit)
                        for b in range(b0, b0 + nb)
                    ]
                    if known
                    else [(0, nbytes)]
                )
                want.setdefault((f, off), (nbytes, []))[1].extend(ranges)
        held = {k: np.empty(max(n, 1), dtype=np.uint8) for k, (n, _) in want.items()}
        spans: dict[str, list[tuple[int, int, int, int]]] = {}
        total = 0
        for (f, off), (_, ranges) in want.items():
            base = held[(f, off)].ctypes.data
            for a, b in union(ranges):
                spans.setdefault(self.paths[f], []).append(
                    (int(self.data_starts[f]) + off + a, b - a, base + a, b - a)
                )
                total += b - a
        rows = rows.copy()
        for row in rows:
            for col in (_DQ_WEIGHT, _DQ_SCALE):
                if row[col] >= 0:
                    row[col : col + 2] = (-1, held[(int(row[col]), int(row[col + 1]))].ctypes.data)
        reader = self._lanes.get()
        try:
            reader.read_many({p: np.array(v, dtype=np.int64) for p, v in spans.items()})
        finally:
            self._lanes.put(reader)
        rows = np.ascontiguousarray(rows)
        _native.dequantize(self.engine, [], rows.ctypes.data, rows.nbytes)
        held.clear()  # the fetched tensors go as soon as the kernel ran
        return total
