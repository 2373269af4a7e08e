"""Bytes fetched ahead for later buckets of a remote load (``GapCache``).

A bucket's spans in an object are often interleaved with a later bucket's: per-expert tensors
lie in key order (expert 0's down, gate and up projections, then expert 1's...), so a bucket
of a fused ``gate_up_proj`` needs every other tensor and the next bucket (``down_proj``) the
ones between. Fetched bucket by bucket, each gap splits a request, and a 1.5 GB MoE
checkpoint takes thousands of small GETs where a couple of hundred large ones would do.

The load knows every byte it will read (``will_read``). A gap made of bytes still to come is
fetched along with its neighbours, held here until the bucket that needs it reads it, and
freed once read. The bytes held are bounded (``budget``); past it, gaps split requests as
before. A byte is fetched once: bytes being fetched or already read are never a gap to fill.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np


def union(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged [start, end) ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class Ranges:
    """Sorted, disjoint [start, end) byte ranges of one object."""

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        merged = union(ranges)
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]

    def covered(self, start: int, end: int) -> int:
        """Bytes of [start, end) inside the ranges."""
        total = 0
        i = bisect.bisect_right(self.ends, start)
        while i < len(self.starts) and self.starts[i] < end:
            total += min(end, self.ends[i]) - max(start, self.starts[i])
            i += 1
        return total

    def remove(self, start: int, end: int) -> None:
        """Takes [start, end) out of the ranges."""
        i = bisect.bisect_right(self.ends, start)
        j = i
        keep: list[tuple[int, int]] = []
        while j < len(self.starts) and self.starts[j] < end:
            if self.starts[j] < start:
                keep.append((self.starts[j], start))
            if self.ends[j] > end:
                keep.append((end, self.ends[j]))
            j += 1
        self.starts[i:j] = [a for a, _ in keep]
        self.ends[i:j] = [b for _, b in keep]


@dataclass(eq=False)
class Held:
    """The bytes [start, end) of one object, fetched ahead of the read that needs them.

    Attributes:
        buf: the bytes (filled when ``ready`` is set, unless ``failed``).
        left: the wanted bytes not read yet; at zero the bytes are freed.
    """

    start: int
    end: int
    buf: np.ndarray
    left: int
    ready: threading.Event = field(default_factory=threading.Event)
    failed: bool = False

    @property
    def address(self) -> int:
        return int(self.buf.ctypes.data)


class GapCache:
    """Which bytes of each object the load will still read, and the gaps fetched ahead.

    Args:
        wanted: per object (the reader's path), the [start, end) ranges the load reads.
        budget: the most bytes held at once.
        slack: bytes of a gap that no read wants that may be fetched along (as the
            requests' own coalescing threshold).

    Thread-safe: the lanes of one engine share it. A read first takes what is held
    (``split``), plans the rest, claims gaps between its requests (``claim``), fetches,
    then marks its claims done (``settle``) before it waits for others' (``take``): no
    lane waits for a claim whose fetch has not started.
    """

    def __init__(self, wanted: Mapping[str, Iterable[tuple[int, int]]], budget: int, slack: int) -> None:
        self._pending = {path: Ranges(r) for path, r in wanted.items()}
        self._held: dict[str, list[Held]] = {}  # by start, disjoint
        self.budget = budget
        self.slack = slack
        self.bytes_held = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def split(self, path: str, rows: np.ndarray) -> tuple[np.ndarray, list[tuple[Held, int, int, int]]]:
        """Rows (file offset, bytes, destination, room) as the rows still to fetch (no longer
        wanted by any gap from now on) and the pieces held: (held, offset, bytes, destination)."""
        fetch: list[tuple[int, int, int, int]] = []
        hits: list[tuple[Held, int, int, int]] = []
        with self._lock:
            held = self._held.get(path, [])
            for off, n, dst, _ in rows.tolist():
                pos, end = off, off + n
                i = max(0, bisect.bisect_right(held, off, key=lambda h: h.start) - 1)
                while i < len(held) and held[i].start < end:
                    h = held[i]
                    i += 1
                    if h.end <= pos:
                        continue
                    if h.start > pos:
                        fetch.append((pos, h.start - pos, dst + pos - off, h.start - pos))
                    a, b = max(pos, h.start), min(end, h.end)
                    hits.append((h, a, b - a, dst + a - off))
                    pos = b
                if pos < end:
                    fetch.append((pos, end - pos, dst + pos - off, end - pos))
            pending = self._pending.get(path)
            if pending is not None:
                for a, n, _, _ in fetch:
                    pending.remove(a, a + n)
        return np.array(fetch, dtype=np.int64).reshape(-1, 4), hits

    def claim(self, path: str, start: int, end: int) -> Held | None:
        """The bytes [start, end) to fetch along with a request, when they are (but for
        ``slack`` bytes) still to be read, touch nothing held, and fit the budget."""
        n = end - start
        with self._lock:
            pending = self._pending.get(path)
            if pending is None or self.bytes_held + n > self.budget:
                return None
            wanted = pending.covered(start, end)
            held = self._held.setdefault(path, [])
            i = bisect.bisect_right(held, start, key=lambda h: h.start)
            overlaps = (i > 0 and held[i - 1].end > start) or (i < len(held) and held[i].start < end)
            if wanted == 0 or n - wanted > self.slack or overlaps:
                return None
            pending.remove(start, end)
            h = Held(start, end, np.empty(n, dtype=np.uint8), wanted)
            held.insert(i, h)
            self.bytes_held += n
            self.peak_bytes = max(self.peak_bytes, self.bytes_held)
            return h

    def settle(self, claims: Iterable[Held], ok: bool) -> None:
        """Marks claims fetched (``ok``) or failed: a failed one is dropped, and a read
        waiting for it fetches its bytes itself."""
        for h in claims:
            if not ok:
                h.failed = True
                self._drop(h)
            h.ready.set()

    def take(self, hits: Iterable[tuple[Held, int, int, int]]) -> list[tuple[int, int, int, int]]:
        """Copies the held pieces to their destinations (waiting for claims in flight);
        returns the rows (offset, bytes, destination, room) whose claim failed."""
        missed: list[tuple[int, int, int, int]] = []
        for h, a, n, dst in hits:
            h.ready.wait()
            if h.failed:
                missed.append((a, n, dst, n))
                continue
            ctypes.memmove(dst, h.address + (a - h.start), n)
            with self._lock:
                h.left -= n
                if h.left <= 0:
                    self._drop(h, locked=True)
        return missed

    def _drop(self, h: Held, locked: bool = False) -> None:
        if not locked:
            with self._lock:
                return self._drop(h, locked=True)
        for held in self._held.values():
            if h in held:
                held.remove(h)
                self.bytes_held -= h.end - h.start
                return None
        return None
