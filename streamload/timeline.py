"""Timeline: where a load's stream spends its time, and in what order its steps ran.

Every load records seconds per stream step (pack, cold read wait, transport
wait, unpack, status checks); they land in ``LoadReport.phases`` as
``"stream.<step>"``. With ``events=True`` (tests) it also keeps the ordered
log of step starts and ends per bucket, so a test can prove that the read of
bucket k+1 was issued before the scatter of bucket k completed from the order
of events, not from a timer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timeline:
    """Seconds per step and, optionally, the ordered event log of one load.

    Args:
        events: keep ``(step, bucket, "start" | "end" | "mark")`` tuples in order.

    Example:
        >>> tl = Timeline(events=True)
        >>> with tl.span("pack", 0):
        ...     pass
        >>> tl.events
        [('pack', 0, 'start'), ('pack', 0, 'end')]
    """

    def __init__(self, events: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}  # e.g. bytes the cold reads took from the disk
        self.events: list[tuple[str, int, str]] | None = [] if events else None
        self.times: list[float] = []  # perf_counter() of each event
        self.bucket = -1  # the bucket the stream is on (helpers log their events against it)
        # Steps run on helper threads too (the cold reader's read-ahead).
        self._lock = threading.Lock()

    def add(self, step: str, seconds: float) -> None:
        """Charges ``seconds`` to ``step``."""
        with self._lock:
            self.seconds[step] = self.seconds.get(step, 0.0) + seconds

    def count(self, what: str, n: int) -> None:
        """Adds ``n`` to the counter ``what``."""
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def mark(self, step: str, bucket: int, what: str = "mark") -> None:
        """Appends one event (when the log is on)."""
        if self.events is not None:
            with self._lock:
                self.events.append((step, bucket, what))
                self.times.append(time.perf_counter())

    @contextmanager
    def span(self, step: str, bucket: int = -1) -> Iterator[None]:
        """Times the block as ``step`` (and logs its start and end for ``bucket``)."""
        self.mark(step, bucket, "start")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(step, time.perf_counter() - t0)
            self.mark(step, bucket, "end")

    def phases(self) -> dict[str, float]:
        """The seconds as ``LoadReport.phases`` entries (``"stream.<step>"``)."""
        with self._lock:
            return {f"stream.{k}": v for k, v in self.seconds.items()}


_NULL = Timeline()
_state = threading.local()
# A test's timeline (``record(events=True)``) seen by every thread of the load.
_override: list[Timeline] = []


def current() -> Timeline:
    """The timeline of the load running on this thread (a throwaway one outside a load)."""
    if _override:
        return _override[-1]
    tl = getattr(_state, "timeline", None)
    return tl if tl is not None else _NULL


@contextmanager
def recording(timeline: Timeline | None = None) -> Iterator[Timeline]:
    """Makes ``timeline`` (default: a new one) the current one on this thread for the block.

    Example:
        >>> with recording() as tl:
        ...     report = run_load(model, path, options)
        >>> report.phases.update(tl.phases())
    """
    tl = timeline if timeline is not None else Timeline()
    prev = getattr(_state, "timeline", None)
    _state.timeline = tl
    try:
        yield tl
    finally:
        _state.timeline = prev


@contextmanager
def observe(events: bool = True) -> Iterator[Timeline]:
    """For tests: one timeline that every load in the block records into, on any thread.

    Example:
        >>> with observe() as tl:
        ...     streamload.load_checkpoint(model, path)
        >>> tl.events[:2]
    """
    tl = Timeline(events=events)
    _override.append(tl)
    try:
        yield tl
    finally:
        _override.remove(tl)
