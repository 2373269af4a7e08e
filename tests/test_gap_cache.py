"""GapCache: gaps between one read's spans that a later read wants are fetched along, held, and
handed to that read; every byte lands where it belongs and is fetched once, with lanes racing,
objects side by side and a claim that fails. The reads go through RemoteReader against objects in
memory. Also the byte extent a load announces per source region (``_region_extent``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Iterable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from streamload.io.gap_cache import GapCache, Ranges, union
from streamload.io.remote import GAP_BYTES, FetchStats, RemoteReader
from streamload.plan.regions import SourceRegion
from streamload.transport.pack import _region_extent

PATH = "s3://b/model.safetensors"
TENSOR = 96 << 10  # wider than GAP_BYTES: each other tensor is a gap


class MemoryFetcher:
    """A Fetcher's read side over bytes in memory; ``fail_over`` fails requests longer than it."""

    def __init__(self, data: bytes, fail_over: int | None = None, delay: float = 0.0) -> None:
        self.data = data
        self.delay = delay
        self.stats = FetchStats()
        self.fail_over = fail_over
        self.ranges: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def run(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run(coro)  # type: ignore[arg-type]

    async def gather(self, coros: Iterable[Awaitable[Any]]) -> list[Any]:
        return list(await asyncio.gather(*coros))

    async def get(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        await asyncio.sleep(self.delay)
        if self.fail_over is not None and end - start > self.fail_over:
            raise ConnectionError(f"{key} {start}-{end}: refused")
        with self._lock:
            self.ranges.append((start, end))
            self.stats.add(end - start, 1, 0)
        return self.data[start:end]


def _layout(experts: int) -> tuple[bytes, list[tuple[int, int]], list[tuple[int, int]]]:
    """An object of ``experts`` x (down, gate, up) tensors in key order; the spans of a fused
    gate_up bucket and of a down bucket."""
    data = np.random.default_rng(0).integers(0, 256, 3 * experts * TENSOR, dtype=np.uint8).tobytes()
    down = [(3 * e * TENSOR, TENSOR) for e in range(experts)]
    gate_up = [((3 * e + 1) * TENSOR, 2 * TENSOR) for e in range(experts)]
    return data, gate_up, down


def _read(reader: RemoteReader, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Reads ``spans`` into a fresh destination; returns it and the bytes expected there."""
    total = sum(n for _, n in spans)
    dst = np.zeros(total, dtype=np.uint8)
    rows, pos = [], 0
    for off, n in spans:
        rows.append((off, n, dst.ctypes.data + pos, n))
        pos += n
    reader.read_many({PATH: np.array(rows, dtype=np.int64)})
    data = np.frombuffer(reader.fetcher.data, dtype=np.uint8)  # type: ignore[attr-defined]
    want = np.concatenate([data[o : o + n] for o, n in spans])
    return dst, want


def _reader(fetcher: MemoryFetcher, cache: GapCache | None) -> RemoteReader:
    return RemoteReader(fetcher, {PATH: ("model.safetensors", "etag")}, lambda: cache)  # type: ignore[arg-type]


def test_ranges_match_a_set_of_bytes() -> None:
    rng = np.random.default_rng(1)
    for _ in range(100):
        pairs = [(int(a), int(a + rng.integers(0, 40))) for a in rng.integers(0, 400, 12)]
        r = Ranges(pairs)
        ref = {x for a, b in pairs for x in range(a, b)}
        assert list(zip(r.starts, r.ends, strict=True)) == union(pairs)
        for _ in range(10):
            a = int(rng.integers(0, 450))
            b = a + int(rng.integers(0, 60))
            assert r.covered(a, b) == len(ref & set(range(a, b)))
            r.remove(a, b)
            ref -= set(range(a, b))
            assert {x for s, e in zip(r.starts, r.ends, strict=True) for x in range(s, e)} == ref
            assert all(s < e for s, e in zip(r.starts, r.ends, strict=True))


def test_interleaved_buckets_share_requests() -> None:
    """A gate_up bucket then a down bucket: with the cache the gaps (the downs) ride along, so
    the two reads take a few large requests instead of one per expert, each byte once."""
    data, gate_up, down = _layout(40)
    counts = {}
    for cached in (False, True):
        fetcher = MemoryFetcher(data)
        cache = (
            GapCache({PATH: [(o, o + n) for o, n in gate_up + down]}, 64 << 20, GAP_BYTES) if cached else None
        )
        reader = _reader(fetcher, cache)
        for spans in (gate_up, down):
            got, want = _read(reader, spans)
            assert np.array_equal(got, want)
        assert fetcher.stats.bytes == len(data)  # nothing fetched twice
        counts[cached] = fetcher.stats.requests
        if cache is not None:
            assert cache.bytes_held == 0 and 0 < cache.peak_bytes <= 40 * TENSOR
    assert counts[False] >= 2 * 40 - 1
    assert counts[True] <= 4, counts  # 11 MiB in 8 MiB requests, and the downs outside any gap


def test_budget_and_bytes_already_read_are_never_gaps() -> None:
    data, gate_up, down = _layout(12)
    wanted = [(o, o + n) for o, n in gate_up + down]
    # No room: every gap splits its request, as without a cache.
    fetcher = MemoryFetcher(data)
    reader = _reader(fetcher, GapCache({PATH: wanted}, TENSOR - 1, GAP_BYTES))
    for spans in (gate_up, down):
        got, want = _read(reader, spans)
        assert np.array_equal(got, want)
    assert fetcher.stats.requests >= 12 + 11
    # The downs first: the gate_ups between them are still to come, so they ride along and
    # the gate_up read takes them from what is held. A down read again (bytes already read)
    # fetches its own spans and no gap: nothing between them is wanted any more.
    fetcher = MemoryFetcher(data)
    cache = GapCache({PATH: wanted}, 64 << 20, GAP_BYTES)
    reader = _reader(fetcher, cache)
    for spans in (down, gate_up):
        got, want = _read(reader, spans)
        assert np.array_equal(got, want)
    assert (fetcher.stats.bytes, fetcher.stats.requests) == (len(data), 2)
    got, want = _read(reader, down)
    assert np.array_equal(got, want)
    assert (fetcher.stats.bytes, fetcher.stats.requests) == (len(data) + 12 * TENSOR, 2 + 12)
    assert cache.bytes_held == 0


def test_lanes_racing_fetch_each_byte_once() -> None:
    """Two lanes at once: the down lane starts while the gate_up lane's requests (carrying the
    downs) are in flight, waits for them and copies from them; also in either order at random."""
    data, gate_up, down = _layout(64)
    for forced in (True, False, False, False):
        fetcher = MemoryFetcher(data, delay=0.2 if forced else 0.0)
        cache = GapCache({PATH: [(o, o + n) for o, n in gate_up + down]}, 64 << 20, GAP_BYTES)
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def lane(k: int, spans: list[tuple[int, int]], fetcher=fetcher, cache=cache, out=out) -> None:
            out[k] = _read(_reader(fetcher, cache), spans)

        first = threading.Thread(target=lane, args=(0, gate_up))
        first.start()
        if forced:
            while cache.bytes_held == 0:  # the gate_up lane has claimed the downs, its GETs wait
                time.sleep(0.001)
        second = threading.Thread(target=lane, args=(1, down))
        second.start()
        first.join()
        second.join()
        assert all(np.array_equal(*out[k]) for k in (0, 1))
        assert fetcher.stats.bytes == len(data)
        assert cache.bytes_held == 0
        if forced:
            assert fetcher.stats.requests <= 6, fetcher.stats.requests  # the downs came from the claims


def test_files_apart_and_a_failure_while_planning() -> None:
    """Two objects with the same offsets keep their own held bytes; a read that fails after its
    first claim (here: its second claim raises) settles that claim, so no lane waits for it."""
    data, gate_up, down = _layout(6)
    other = "s3://b/other.safetensors"
    fetcher = MemoryFetcher(data)
    wanted = [(o, o + n) for o, n in gate_up + down]
    cache = GapCache({PATH: wanted, other: wanted}, 64 << 20, GAP_BYTES)
    reader = RemoteReader(fetcher, {PATH: ("a", "e"), other: ("b", "e")}, lambda: cache)  # type: ignore[arg-type]
    src = np.frombuffer(data, dtype=np.uint8)
    for spans in (gate_up, down):
        dst = {p: np.zeros(sum(n for _, n in spans), dtype=np.uint8) for p in (PATH, other)}
        rows = {}
        for p in (PATH, other):
            pos, r = 0, []
            for off, n in spans:
                r.append((off, n, dst[p].ctypes.data + pos, n))
                pos += n
            rows[p] = np.array(r, dtype=np.int64)
        reader.read_many(rows)
        want = np.concatenate([src[o : o + n] for o, n in spans])
        assert all(np.array_equal(dst[p], want) for p in (PATH, other))
    assert cache.bytes_held == 0 and fetcher.stats.bytes == 2 * len(data)

    cache = GapCache({PATH: wanted}, 64 << 20, GAP_BYTES)
    made: list = []
    real = cache.claim

    def claim_once(path: str, start: int, end: int):
        if made:
            raise MemoryError("no room")
        made.append(real(path, start, end))
        return made[-1]

    cache.claim = claim_once  # type: ignore[method-assign]
    with pytest.raises(MemoryError):
        _read(_reader(MemoryFetcher(data), cache), gate_up)
    assert made and made[0] is not None and made[0].ready.is_set() and made[0].failed
    assert cache.bytes_held == 0


def test_announced_extent_covers_exactly_the_region() -> None:
    """``_region_extent`` (what a load announces per source region) against the element offsets
    the region reads, for row and column slices, transposed regions and stacked dims."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(x) for x in rng.integers(1, 7, ndim))
        start = tuple(int(rng.integers(0, n)) for n in shape)
        size = tuple(int(rng.integers(1, n - s + 1)) for n, s in zip(shape, start, strict=True))
        order = [int(d) for d in rng.permutation(ndim)]
        dims: list[int | None] = list(order)
        reg_shape = [size[d] for d in order]
        if rng.random() < 0.3:  # a stacked dim of one element
            k = int(rng.integers(0, ndim + 1))
            dims.insert(k, None)
            reg_shape.insert(k, 1)
        itemsize = int(rng.choice([1, 2, 4]))
        info = SimpleNamespace(dtype={1: "U8", 2: "BF16", 4: "F32"}[itemsize], shape=shape, begin=4096)
        reg = SourceRegion("t", tuple(reg_shape), start, tuple(dims), (0,) * len(dims))
        elems = np.arange(int(np.prod(shape))).reshape(shape)
        read = elems[tuple(slice(s, s + n) for s, n in zip(start, size, strict=True))]
        assert _region_extent(info, reg) == (
            4096 + int(read.min()) * itemsize,
            4096 + (int(read.max()) + 1) * itemsize,
        )


def test_a_failed_claim_is_fetched_by_the_read_that_wants_it() -> None:
    """A read whose requests (with their gaps) fail raises and drops its claims; a read waiting
    for a claim in flight that then fails fetches those bytes itself."""
    data, gate_up, down = _layout(8)
    fetcher = MemoryFetcher(data, fail_over=3 * TENSOR)
    cache = GapCache({PATH: [(o, o + n) for o, n in gate_up + down]}, 64 << 20, GAP_BYTES)
    reader = _reader(fetcher, cache)
    with pytest.raises(ConnectionError, match="refused"):
        _read(reader, gate_up)
    assert cache.bytes_held == 0  # the failed claims are dropped
    got, want = _read(reader, down)
    assert np.array_equal(got, want)

    fetcher = MemoryFetcher(data)
    cache = GapCache({PATH: [(o, o + n) for o, n in down]}, 64 << 20, GAP_BYTES)
    held = cache.claim(PATH, down[3][0], down[3][0] + TENSOR)  # another lane's, in flight
    assert held is not None
    out: list[tuple[np.ndarray, np.ndarray]] = []
    waiting = threading.Thread(target=lambda: out.append(_read(_reader(fetcher, cache), down[2:5])))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()  # it waits for the claim
    cache.settle([held], ok=False)
    waiting.join(10)
    assert not waiting.is_alive() and np.array_equal(*out[0])
    assert fetcher.stats.bytes == 3 * TENSOR
