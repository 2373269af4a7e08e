"""Arrival: every rank of a call's group is there before the first collective, or a named error.

A collective waits for every peer, and the only limit is the process group's own (gloo: 30
minutes by default; NCCL: its watchdog). A rank that raised before it called streamload (its
framework's code, a config one node lacks) or returned early would leave the others waiting
there. So each public entry point first meets its peers in torch.distributed's rendezvous store
(a key per rank and a counter, no collective: gloo and NCCL alike), and only the meeting has a
deadline: ``timeout`` seconds (keyword, else ``STREAMLOAD_TIMEOUT``, else 300) without every
peer arriving. A healthy load of any length is never cut short: once every rank is in, the
load's own error protocol (``protocol.py``) takes over.

The meeting's outcome is decided once, atomically (``compare_set`` on one key), so every rank
that looks sees the same verdict: ``go``; ``absent:<ranks>`` (the deadline passed first: every
waiting rank raises ``RankAbsentError`` naming them, and a late rank that arrives afterwards
raises it too instead of entering a collective alone); ``differ:<text>`` (the ranks called
different entry points or passed options that must agree: ``OptionMismatchError``);
``left:<rank>`` (a rank was interrupted while it waited).

Inside the call, a transport error that means a peer is gone (gloo's "Connection closed by
peer") becomes ``RankLostError``: the survivors take a roll call in the store and name the
ranks that did not answer, with what they posted when they left (an exception's text) if they
could. A first Ctrl-C inside a call is deferred to the next agreement, where it reaches every
peer as a named error and raises ``KeyboardInterrupt`` on its own rank (a second Ctrl-C raises
at once); an interrupt inside gloo's two-part object gather would abort the process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import OptionMismatchError, RankAbsentError, RankLostError, StreamloadError
from ..options import ENV_OVERRIDES, force_multi_rank
from ..timeline import MARK_HOOKS

DEFAULT_TIMEOUT = 300.0
ENV = ENV_OVERRIDES["timeout"]
# How long survivors of a lost peer wait for each other's answer to the roll call.
ROLL_CALL_SECONDS = 10.0
_LOST_MARKERS = (
    "streamload: a peer said:",
    "streamload: no progress:",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "end of file",
    "connection refused",
)


def resolve_timeout(timeout: float | None) -> float:
    """The meeting's deadline in seconds: ``timeout`` when given, else ``STREAMLOAD_TIMEOUT``,
    else ``DEFAULT_TIMEOUT``.

    Raises:
        ValueError: not a positive number (a typo must not pass for "wait for ever").

    Example:
        >>> resolve_timeout(None)  # STREAMLOAD_TIMEOUT=60 -> 60.0; unset -> 300.0
    """
    raw: Any = timeout
    name = "timeout="
    if raw is None:
        raw = os.environ.get(ENV, "").strip() or DEFAULT_TIMEOUT
        name = f"{ENV}="
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}{raw!r}: expected a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}{raw!r}: expected a positive number of seconds")
    return value


def default_store() -> dist.Store:
    """torch.distributed's rendezvous store (a private accessor: tests/test_arrival.py fails
    loudly when torch renames it)."""
    from torch.distributed import distributed_c10d

    get = getattr(distributed_c10d, "_get_default_store", None)
    if get is None:  # pragma: no cover - torch changed
        raise RuntimeError("streamload: torch.distributed.distributed_c10d._get_default_store is gone")
    return get()


@dataclass
class Meeting:
    """One call's meeting: where its keys live and what it knows about its peers."""

    step: str
    ranks: tuple[int, ...]  # the group's global ranks, in group rank order
    me: int  # group rank
    base: str
    timeout: float
    store: Any
    phase: str = "start"  # the last phase the call's clock marked (``note_phase``)
    pending_interrupt: bool = field(default=False)

    @property
    def world(self) -> int:
        return len(self.ranks)

    def key(self, what: str, rank: int | None = None) -> str:
        return f"{self.base}/{what}" if rank is None else f"{self.base}/{what}/r{rank}"


_local = threading.local()
_calls: dict[str, int] = {}  # a group's key -> calls met so far by this process


def current() -> Meeting | None:
    """The meeting of the call this thread is in, if any."""
    return getattr(_local, "meeting", None)


def note_phase(phase: str) -> None:
    """Records where the current call is, for the errors that name it (every ``PhaseClock.mark``)."""
    m = current()
    if m is not None:
        m.phase = phase


MARK_HOOKS.append(note_phase)


def take_interrupt() -> bool:
    """True once when a Ctrl-C was deferred inside the current call (then it is consumed)."""
    m = current()
    if m is None or not m.pending_interrupt:
        return False
    m.pending_interrupt = False
    return True


def interrupt_pending() -> bool:
    m = current()
    return m is not None and m.pending_interrupt


def _group_ranks(group: Any) -> tuple[int, ...] | None:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    return ranks if len(ranks) > 1 or force_multi_rank() else None


@contextlib.contextmanager
def meeting(
    step: str, group: Any, timeout: float | None = None, agree: dict[str, Any] | None = None
) -> Iterator[Meeting | None]:
    """Meets the peers of ``group`` before the call's first collective; maps lost peers to
    ``RankLostError`` and defers Ctrl-C inside the call.

    A call made inside another (``from_pretrained`` calling ``load_checkpoint``) is part of
    the outer meeting. One process, or a group of one (unless ``STREAMLOAD_FORCE_MULTI_RANK``): nothing to meet.

    Args:
        step: the entry point (named in the errors).
        group: the call's process group (None: no torch.distributed).
        timeout: seconds to wait for peers that have not arrived (see ``resolve_timeout``).
        agree: per-call options that every rank must pass alike (name -> value; compared
            as their ``repr``).

    Raises:
        RankAbsentError, OptionMismatchError, RankLostError: see the module docstring.

    Example:
        >>> with meeting("load_checkpoint", group, timeout, {"src_rank": 0}):
        ...     ...  # collectives
    """
    limit = resolve_timeout(timeout)
    ranks = _group_ranks(group)
    if current() is not None or ranks is None:
        yield current()
        return
    gid = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    seq = _calls.get(gid, 0) + 1
    _calls[gid] = seq
    m = Meeting(step, ranks, dist.get_rank(group), f"streamload/meet/{gid}/{seq}", limit, default_store())
    with _deferred_sigint(m):
        _arrive(m, json.dumps({"step": step, **{k: _shown(v) for k, v in (agree or {}).items()}}))
        _local.meeting = m
        try:
            yield m
        except BaseException as exc:
            _post_left(m, exc)
            with contextlib.suppress(Exception):  # peers waiting on this rank stop waiting
                m.store.set(m.key("lost"), f"rank {m.me} left {m.step} ({type(exc).__name__})")
            if lost_peer(exc):
                raise _roll_call(m, exc) from exc
            if m.pending_interrupt and not isinstance(exc, KeyboardInterrupt):
                raise KeyboardInterrupt from exc  # the user's Ctrl-C is not lost to the other error
            raise
        finally:
            _local.meeting = None
    if m.pending_interrupt:  # the call ended before an agreement could carry it
        raise KeyboardInterrupt


def _arrive(m: Meeting, mine: str) -> None:
    store = m.store
    outcome_key = m.key("outcome")
    store.set(m.key("in", m.me), mine)
    if store.add(m.key("count"), 1) >= m.world:
        store.compare_set(outcome_key, "", _verdict(m))
    deadline = time.monotonic() + m.timeout
    outcome = ""
    decider = False
    while not outcome:
        left = deadline - time.monotonic()
        try:
            store.wait([outcome_key], timedelta(seconds=max(0.05, min(1.0, left))))
            outcome = store.get(outcome_key).decode()
        except KeyboardInterrupt:
            store.compare_set(outcome_key, "", f"left:{m.me}")
            raise
        except RuntimeError as exc:  # the slice's wait timed out: look again
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise _store_gone(m, exc) from exc
            if m.pending_interrupt:  # Ctrl-C while waiting: leave, unless the peers already went on
                outcome = store.compare_set(outcome_key, "", f"left:{m.me}").decode()
                if outcome != "go":
                    m.pending_interrupt = False
                    raise KeyboardInterrupt from None
            elif time.monotonic() >= deadline and (
                decider or store.add(m.key("decide"), 1) == 1 or time.monotonic() >= deadline + 5.0
            ):
                # One rank (the first past its deadline) lists the absent: W checks, not W x W;
                # 5 s later any rank does, should that one have died or been interrupted meanwhile.
                decider = True
                absent = [r for r in range(m.world) if not store.check([m.key("in", r)])]
                if absent:  # else the last rank is arriving right now: its verdict comes next
                    outcome = store.compare_set(outcome_key, "", "absent:" + json.dumps(absent)).decode()
    if outcome == "go":
        _forget(m)
        return
    kind, _, detail = outcome.partition(":")
    where = f"in {m.step} (group of {m.world} ranks, global ranks {_short(m.ranks)})"
    if kind == "differ":
        raise OptionMismatchError(f"{detail} {where}", rank=m.me, hint="pass the same options on every rank")
    if kind == "left":
        raise RankLostError(
            f"rank {detail} was interrupted while waiting for its peers {where}",
            rank=m.me,
            ranks=[int(detail)],
            step=m.step,
        )
    absent = json.loads(detail)
    late = m.me in absent
    reason = (
        f"arrived after its peers stopped waiting ({m.timeout:g} s) for ranks {absent}"
        if late
        else f"ranks {absent} did not arrive within {m.timeout:g} s"
    )
    raise RankAbsentError(
        f"{reason} {where}",
        rank=m.me,
        ranks=absent,
        step=m.step,
        hint="every rank of the group must call it; look for an earlier error on those ranks "
        f"(their logs), or raise timeout= / {ENV} if they are only slow to get there",
    )


def _store_gone(m: Meeting, exc: BaseException) -> RankLostError:
    return RankLostError(
        f"the rendezvous store is unreachable in {m.step} ({exc}): the process that hosts it "
        "(global rank 0 under init_method tcp:// or env://, else the launcher) is gone",
        rank=m.me,
        step=m.step,
        hint="the job cannot continue: restart it",
    )


def _forget(m: Meeting) -> None:
    """Deletes the keys of this group's meeting before the last: every rank arrived at the last
    one, so every rank has read that one's verdict (the store holds two meetings per group)."""
    old = m.base.rsplit("/", 1)[0] + f"/{int(m.base.rsplit('/', 1)[1]) - 2}"
    mine = [f"{old}/{w}/r{m.me}" for w in ("in", "left", "alive")]
    shared = [f"{old}/{w}" for w in ("count", "outcome", "lost", "decide", "alive")] if m.me == 0 else []
    for key in mine + shared:
        with contextlib.suppress(Exception):
            m.store.delete_key(key)


def _verdict(m: Meeting) -> str:
    """The last rank in compares what every rank posted: ``go`` or ``differ:<which>``."""
    keys = [m.key("in", r) for r in range(m.world)]
    posted = [json.loads(v) for v in m.store.multi_get(keys)]
    for name in sorted({k for p in posted for k in p}, key=lambda k: (k != "step", k)):
        values: dict[str, list[int]] = {}
        for r, p in enumerate(posted):
            values.setdefault(str(p.get(name, "<not passed>")), []).append(r)
        if len(values) > 1:
            what = "called different entry points" if name == "step" else f"passed different {name}="
            shown = "; ".join(f"{v} on ranks {_short(rs)}" for v, rs in values.items())
            return f"differ:the ranks {what}: {shown}"
    return "go"


def _shown(value: Any) -> str:
    """An option's value as compared across ranks (an enum by its value: "src" == ReaderMode.SRC)."""
    return repr(getattr(value, "value", value))


def _short(ranks: Any) -> str:
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)} ranks)"


def wait_work(
    work: Any, device: Any = None, *, deadline: float | None = None, watch: Callable[[], None] | None = None
) -> None:
    """``work.wait()``, except that inside a call, for a collective on CPU tensors (gloo), it
    waits in one-second slices and between them asks the store whether a peer left: a rank
    whose collective stalls on a live peer that already left (it saw the loss, or raised, in
    an earlier step) would otherwise wait for the group's own timeout. A collective that
    completes within the first slice costs nothing more than ``wait()``.

    A slice that ran out (the work is still pending) is told from the work's own failure (gloo's
    own timeout, a closed connection: the work completed with an error, raised as it is), so the
    group's timeout is never taken for a slice and retried.

    Args:
        work: the collective's work handle (None: nothing to wait for).
        device: the tensors' device; on a device (NCCL) ``wait()`` only orders the stream and is
            left as it is.
        deadline: seconds the collective may take at most (the call's ``timeout`` for a sync,
            whose collectives each wait on one step of every peer); past it, a lost-peer error
            (the call's meeting then takes the roll call and names who is gone). None: no limit
            but the group's own.
        watch: called between slices; raises when what the collective also waits on is gone
            (e.g. a separate engine's process).

    Example:
        >>> wait_work(dist.all_reduce(t, async_op=True), t.device, deadline=300.0)
    """
    m = current()
    if work is None:
        return
    if m is None or (device is not None and getattr(device, "type", "cpu") != "cpu"):
        work.wait()
        return
    t0 = time.monotonic()
    while True:
        try:
            work.wait(timedelta(seconds=1))
            return
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            if work.is_completed():  # gloo's own timeout, or done just now: not the slice's end
                work.wait()  # returns, or raises the work's own error
                return
        if m.store.check([m.key("lost")]):
            raise RuntimeError(f"streamload: a peer said: {m.store.get(m.key('lost')).decode()}")
        if watch is not None:
            watch()
        if deadline is not None and time.monotonic() - t0 > deadline:
            raise RuntimeError(
                f"streamload: no progress: a collective of {m.step} did not complete within {deadline:g} s"
            )


def raise_if_lost(exc: BaseException) -> None:
    """Re-raises ``exc`` when it says a peer is gone: after that no collective can complete, so
    error paths that would announce it in a status check or an agreement must not try."""
    if lost_peer(exc):
        raise exc


def _post_left(m: Meeting, exc: BaseException) -> None:
    with contextlib.suppress(Exception):
        m.store.set(m.key("left", m.me), f"{type(exc).__name__}: {str(exc)[:300]} (in {m.phase})")


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is the transport saying a peer is gone (gloo's closed connection)."""
    if isinstance(exc, StreamloadError) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _LOST_MARKERS)


def _roll_call(m: Meeting, exc: BaseException) -> RankLostError:
    """After a transport error: which ranks are still here? Each survivor answers in the store
    and waits up to ``ROLL_CALL_SECONDS`` for the others."""
    store = m.store
    unheard = set(range(m.world)) - {m.me}
    try:
        store.set(m.key("alive", m.me), "1")
        answered = store.add(m.key("alive"), 1)
        deadline = time.monotonic() + min(ROLL_CALL_SECONDS, m.timeout)
        while answered < m.world and time.monotonic() < deadline:  # one counter read per poll
            time.sleep(0.1)
            answered = store.add(m.key("alive"), 0)
        unheard = {r for r in unheard if not store.check([m.key("alive", r)])}
        notes = [
            f"rank {r}: {store.get(m.key('left', r)).decode()}"
            for r in sorted(unheard)
            if store.check([m.key("left", r)])
        ]
    except Exception as store_error:  # noqa: BLE001 - the store's host may be the lost rank
        return _store_gone(m, store_error)
    lost = sorted(unheard)
    said = ("; they left with: " + "; ".join(notes)) if notes else " (killed, or its host is gone)"
    return RankLostError(
        f"lost ranks {lost} of {m.step}'s group after its '{m.phase}' phase{said}; transport said: {exc}",
        rank=m.me,
        ranks=lost,
        step=m.step,
        hint="the process group is unusable now: destroy it (dist.destroy_process_group) and restart the job",
    )


@contextlib.contextmanager
def _deferred_sigint(m: Meeting) -> Iterator[None]:
    """A first Ctrl-C sets ``m.pending_interrupt``; a second raises at once (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:  # the user's own handler stays in charge
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if m.pending_interrupt:
            raise KeyboardInterrupt
        m.pending_interrupt = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
