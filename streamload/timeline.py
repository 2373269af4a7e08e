"""Timeline: where a load spends its time, and in what order its stream's steps ran.

``PhaseClock`` times the whole load as consecutive phases (open, readers, match,
materialize, ..., stream, ties, finalize): they add up to the load's wall time.
Within the stream, every load records seconds per stream step (pack, cold read wait, transport
wait, unpack, status checks); they land in ``LoadReport.phases`` as
``"stream.<step>"``. With ``events=True`` (tests) it also keeps the ordered
log of step starts and ends per bucket, so a test can prove that the read of
bucket k+1 was issued before the scatter of bucket k completed from the order
of events, not from a timer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Called with each phase a ``PhaseClock`` marks (``transport.arrival`` names the phase a call was
# in when a peer was lost).
MARK_HOOKS: list[Callable[[str], None]] = []


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


class PhaseClock:
    """Seconds per named phase of one load, from one start.

    Top-level phases (names without a dot) follow one another: each ``mark`` charges
    the time since the previous one, so together they add up to the wall time from
    ``start`` to the last mark. A dotted name (``"open.config"``) breaks its parent
    phase down (``part``) and is not counted again.

    Example:
        >>> clock = PhaseClock()
        >>> with clock.part("open.config"):
        ...     read_config()
        >>> clock.mark("open")
        >>> sum(top_level(clock.phases).values()) == clock.total()
        True
    """

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """Charges the time since the previous mark (or the start) to phase ``name``."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now
        for hook in MARK_HOOKS:
            hook(name)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Times the block as ``name``, a breakdown of the phase it runs in (no mark)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def total(self) -> float:
        """Seconds from the start to the last mark: the sum of the top-level phases."""
        return self.last - self.start


def top_level(phases: dict[str, float]) -> dict[str, float]:
    """The phases that add up to the load's wall time (names without a dot)."""
    return {k: v for k, v in phases.items() if "." not in k}


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
