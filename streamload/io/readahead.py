"""Read-ahead for cold reads: chunks of explicit reads kept in flight across batches.

``ColdEngine`` cuts each batch of copy ops into chunks of source spans; a chunk
is read into one of a fixed set of read buffers on a helper thread, then the
engine copies out of it. ``ReadAhead`` owns the buffers' turns: a chunk's read
is issued as soon as a buffer is free, in file order, including the chunks of
the *next* batch once it was announced (``announce``). So while bucket k's last
chunks are copied, or bucket k is scattered and its status agreed, the disk is
already reading bucket k+1 (up to the read buffers' size: one bucket ahead, no further).

Memory is fixed: ``buffers`` read buffers, whatever the number of batches
announced (an announced batch holds no read buffer until one frees). A chunk's
read may also write the caller's memory (the cold engine lands plain copies in
their destinations), so ``drain`` must run before that memory is given up.

Fork: the helper threads do not exist in a child of ``os.fork()``, and a read in
flight there never completes. Every live ``ReadAhead`` is reset in the child
(``reset_in_child``: no pool, no batch, every buffer free) so the child's first
read starts a pool of its own instead of waiting on the parent's.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from ..timeline import Timeline

R = TypeVar("R")  # what a chunk's read returns


@dataclass
class Batch(Generic[R]):
    """One batch of ops: its chunks and the reads issued for them."""

    key: np.ndarray  # the batch's op rows as announced (a later execute must match them)
    chunks: list[np.ndarray]
    tag: int = -1  # the bucket it packs (what its logged reads name)
    futures: list[Future[R]] = field(default_factory=list)
    buffers: list[int] = field(default_factory=list)

    @property
    def issued(self) -> int:
        return len(self.futures)


class ReadAhead(Generic[R]):
    """Issues chunk reads into ``buffers`` read buffers, batch after batch, in order.

    Args:
        read: ``read(chunk_rows, buffer) -> R`` (runs on the helper thread; the cold engine's
            returns the rows rewritten to copy from that buffer, and the bytes it read in place).
        buffers: read buffers (>= 2: one is copied while the next is read).
        lanes: chunk reads in flight at once (helper threads).

    Example:
        >>> ra = ReadAhead(engine._read_chunk, 4)
        >>> ra.announce(rows_k1, chunks_k1)  # bucket k+1, before bucket k is executed
    """

    def __init__(
        self,
        read: Callable[[np.ndarray, int], R],
        buffers: int,
        lanes: int = 1,
        on_fork: Callable[[], None] | None = None,
    ) -> None:
        if buffers < 2:
            raise ValueError("read-ahead needs at least two buffers")
        # A weak reference to a bound method: the engine owns this object, and a strong one
        # would make a cycle that keeps the engine's buffers and threads alive until a full GC.
        self._read: Callable[[], Callable[[np.ndarray, int], R] | None] = (
            weakref.WeakMethod(read) if hasattr(read, "__self__") else (lambda: read)
        )
        self.buffers = buffers
        self.lanes = max(1, min(lanes, buffers - 1))  # reads at once; one buffer is always being copied
        self._free = list(range(buffers - 1, -1, -1))
        self._batches: deque[Batch[R]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self.timeline: Timeline | None = None  # where issued reads are logged
        # What the owner resets in a fork child (the cold engine: its native readers); weak, as ``read``.
        self._on_fork: Callable[[], Callable[[], None] | None] | None = None
        if on_fork is not None:
            hook = on_fork
            self._on_fork = weakref.WeakMethod(hook) if hasattr(hook, "__self__") else (lambda: hook)
        _LIVE.add(self)

    def reset_in_child(self) -> None:
        """In a child of ``os.fork()``: forgets the parent's helper threads and reads.

        The parent's pool has no thread here and its queued reads never run: waiting on
        them is a hang. The pool is dropped (never shut down: that would join threads that
        do not exist), announced batches are forgotten (their reads may have been half
        done; a later ``start`` reads them again) and every buffer is free.
        """
        self._pool = None
        self._batches = deque()
        self._free = list(range(self.buffers - 1, -1, -1))
        hook = self._on_fork() if self._on_fork is not None else None
        if hook is not None:
            hook()

    def announce(self, key: np.ndarray, chunks: list[np.ndarray], tag: int = -1) -> None:
        """Queues a batch whose reads start as soon as buffers free up (``tag``: its bucket)."""
        self._batches.append(Batch(key, chunks, tag))
        self.pump()

    def announced(self, key: np.ndarray) -> bool:
        """True when the next announced batch is ``key`` (its chunks are planned already)."""
        return bool(self._batches) and np.array_equal(self._batches[0].key, key)

    def start(self, key: np.ndarray, chunks: list[np.ndarray], tag: int = -1) -> Batch[R]:
        """The batch to execute now: the announced head if its ops are ``key``;
        otherwise every announcement is stale (dropped) and ``chunks`` start now."""
        if self.announced(key):
            batch = self._batches[0]
        else:
            self.drain()
            batch = Batch(key, chunks, tag)
            self._batches.append(batch)
        self.pump()
        return batch

    def pump(self) -> None:
        """Issues reads while buffers are free: the oldest batch's chunks first (file order)."""
        for batch in self._batches:
            while batch.issued < len(batch.chunks):
                if not self._free:
                    return
                which = self._free.pop()
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.lanes, thread_name_prefix="streamload-cold")
                if self.timeline is not None:
                    self.timeline.mark("read", batch.tag, "start")
                batch.buffers.append(which)
                batch.futures.append(self._pool.submit(self._call, batch.chunks[batch.issued], which))

    def _call(self, rows: np.ndarray, which: int) -> R:
        read = self._read()
        if read is None:
            raise RuntimeError("the cold engine that owned this read-ahead is gone")
        return read(rows, which)

    def wait(self, batch: Batch[R], i: int) -> R:
        """Chunk ``i`` of ``batch`` read; returns what its read returned."""
        if i >= batch.issued:
            raise AssertionError(f"chunk {i} waited for before it was issued")
        return batch.futures[i].result()

    def done(self, batch: Batch[R], i: int) -> None:
        """Chunk ``i`` was copied out: its buffer takes the next read."""
        self._free.append(batch.buffers[i])
        if i == len(batch.chunks) - 1:
            assert self._batches[0] is batch
            self._batches.popleft()
        self.pump()

    def drain(self) -> None:
        """Waits for every read in flight (none may write into a freed buffer), drops
        every queued batch and frees every buffer; read errors are dropped with them."""
        batches, self._batches = self._batches, deque()
        for batch in batches:
            for fut in batch.futures:
                fut.cancel()
            for fut in batch.futures:
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001, S110 - a dropped read's error is nobody's
                    pass
        self._free = list(range(self.buffers - 1, -1, -1))

    def close(self) -> None:
        """Drains and stops the helper thread."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# Every live ReadAhead, for the fork child handler (weak: a registry must not keep engines alive).
_LIVE: weakref.WeakSet[ReadAhead[Any]] = weakref.WeakSet()


def _reset_all_in_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: every live ReadAhead forgets its parent's threads."""
    for ahead in list(_LIVE):
        ahead.reset_in_child()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork to survive
    os.register_at_fork(after_in_child=_reset_all_in_child)
