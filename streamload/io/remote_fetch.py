"""Ranged GETs against an object store: the requests, their retries, and where their bytes go.

``Fetcher`` runs a store's requests on one event loop thread, ``concurrency`` in flight (16),
each retried on throttling, 5xx answers, timeouts, resets and short bodies with exponential
backoff and jitter (``retries`` per request, 8; none starts 120 s after the request's first
failure); what still fails is a named ``RemoteError`` (``_named``). ``plan_requests`` cuts a
read's byte spans into requests (neighbours closer than ``GAP_BYTES`` share one, none is over
``PIECE_BYTES``), and ``RemoteReader``, a lane reader of ``ColdEngine``, fetches them into their
destinations (the gaps a later read wants go to the ``GapCache``).

What one attempt may take is the client's (``remote_store``): no connection within
``connect_timeout`` (10 s), or no byte within ``timeout`` (30 s, the answer's first byte and each
next read of its body), fails it; a body that keeps arriving is never cut for its length
(under an hour). A connection that stops sending mid-body therefore fails each attempt after
``timeout``, and the request ends as ``RemoteTimeoutError`` once its retries are spent: at the
defaults within about 3 minutes of the stall (``timeout``, then retries for up to 120 s, the
last one up to ``connect_timeout`` + ``timeout`` long).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from .gap_cache import GapCache, Held
from .remote_store import RemoteError, RemoteObjectChangedError, RemotePath, RemoteTimeoutError, make_store

T = TypeVar("T")

PIECE_BYTES = 8 << 20  # bytes per request at most
GAP_BYTES = 8 << 10  # spans closer than this share a request (the gap is fetched too, and may be another
# bucket's bytes: kept small, it costs at most this much per span)
DEFAULT_RETRIES = 8
DEFAULT_CONCURRENCY = 16
BACKOFF_S = (0.05, 4.0)  # first and largest backoff
RETRY_DEADLINE_S = 120.0  # no retry starts this long after a request's first failure

_STATUS = re.compile(r"status code: (\d{3})")


def _status(exc: BaseException) -> int | None:
    """The HTTP status an obstore error reports, if any."""
    m = _STATUS.search(str(exc))
    return int(m.group(1)) if m else None


def _retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, timeouts, resets and short bodies; not 4xx refusals or missing objects."""
    from obstore import exceptions as oe

    if isinstance(exc, (FileNotFoundError, oe.NotFoundError, oe.PreconditionError)):
        return False
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError, oe.InvalidPathError)):
        return False
    code = _status(exc)
    if code is not None:
        return (code >= 500 and code not in (501, 505)) or code in (408, 429)
    return True  # connection reset, timeout, body cut short: the transport's, worth another try


_TIMED_OUT = re.compile(r"kind: Timeout\b|\bTimedOut\b")


def _timed_out(exc: BaseException) -> bool:
    """True when the attempt failed on a timeout of the client (connect, first byte or next read):
    a transport failure (no status answered) whose cause obstore reports as a timeout."""
    if _status(exc) is not None:
        return False  # an answer came: whatever the text holds (a key named TimedOut), not a timeout
    return isinstance(exc, TimeoutError) or bool(_TIMED_OUT.search(str(exc)))


def _named(exc: BaseException, url: str, what: str, attempts: int, timeout: str = "") -> RemoteError:
    """The RemoteError a request that failed for good with ``exc`` raises (``timeout``: the wait
    for bytes its attempts had, for the message)."""
    from obstore import exceptions as oe

    first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    if isinstance(exc, oe.PreconditionError):
        return RemoteObjectChangedError(
            f"the object changed during the load ({what}: its ETag is no longer the one the table was "
            "read from); nothing of the new version was used",
            url,
            hint="load again once the upload is complete",
        )
    if isinstance(exc, (FileNotFoundError, oe.NotFoundError)):
        return RemoteError(f"no such object ({what})", url)
    # The status the response carried, never a number anywhere in the message (a 503 on the key
    # checkpoint-403/ is a store failure, not a refusal).
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)) or _status(exc) in (401, 403):
        return RemoteError(
            f"access denied ({what}): {first}",
            url,
            hint="check the credentials (AWS_* environment, profile) or storage_options",
        )
    if _timed_out(exc):
        return RemoteTimeoutError(
            f"{what} failed after {attempts} attempt(s): timed out (no connection within connect_timeout, "
            f"or no byte for {timeout or 'timeout'}): {type(exc).__name__}: {first}",
            url,
            hint="a link that is slow but sending never times out; raise storage_options['timeout'] "
            "only for a store that is silent that long before it answers",
        )
    return RemoteError(f"{what} failed after {attempts} attempt(s): {type(exc).__name__}: {first}", url)


@dataclass
class FetchStats:
    """What a reader fetched: bytes (gaps included), requests and retries."""

    bytes: int = 0
    requests: int = 0
    retries: int = 0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, requests: int, retries: int) -> None:
        with self.lock:
            self.bytes += nbytes
            self.requests += requests
            self.retries += retries


class Fetcher:
    """Ranged GETs against one store, on one event loop thread, ``concurrency`` in flight.

    Thread-safe: lane threads call ``run`` at once; their requests share the loop and its limit.
    """

    def __init__(self, remote: RemotePath) -> None:
        self.remote = remote
        self.store = make_store(remote)
        self.retries = remote.setting("retries", DEFAULT_RETRIES)
        self.concurrency = max(1, remote.setting("concurrency", DEFAULT_CONCURRENCY))
        self.stats = FetchStats()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limit: asyncio.Semaphore | None = None
        self._pid = os.getpid()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                # A fork child has no loop thread: it starts its own (and a new client).
                if self._pid != os.getpid():
                    self.store = make_store(self.remote)
                    self._pid = os.getpid()
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="streamload-remote", daemon=True).start()
                self._loop = loop
                self._limit = None
            return self._loop

    def close(self) -> None:
        """Stops the loop thread (a later ``run`` starts another)."""
        with self._lock:
            if self._loop is not None and self._pid == os.getpid():
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    def run(self, coro: Awaitable[T]) -> T:
        """Runs ``coro`` on the loop thread and waits for it. Interrupted (KeyboardInterrupt, ...),
        it cancels the coroutine and waits until it has stopped: no request may still copy into
        memory its caller is about to free."""
        started, finished = threading.Event(), threading.Event()

        async def guarded() -> T:
            started.set()
            try:
                return await coro
            finally:
                finished.set()

        future = asyncio.run_coroutine_threadsafe(guarded(), self._running_loop())
        try:
            return future.result()
        except BaseException:
            future.cancel()
            # A coroutine cancelled before it started never runs: then there is nothing to wait for.
            finished.wait(timeout=120 if started.is_set() else 1)
            raise

    def _semaphore(self) -> asyncio.Semaphore:
        if self._limit is None:  # made on the loop thread (bound to its loop)
            self._limit = asyncio.Semaphore(self.concurrency)
        return self._limit

    async def _retrying(self, url: str, what: str, call: Callable[[], Awaitable[T]]) -> tuple[T, int]:
        """``call()`` with retries and backoff; (its result, retries made) or a named RemoteError.

        No retry starts ``RETRY_DEADLINE_S`` after the first failure: the deadline bounds a
        failing request, not a slow one (an attempt that is still receiving spends none of it,
        nor does the wait for a slot among the ``concurrency`` in flight)."""
        attempt = 0
        failed: float | None = None
        while True:
            try:
                async with self._semaphore():
                    return await call(), attempt
            except Exception as exc:  # noqa: BLE001 - classified below
                if isinstance(exc, RemoteError):
                    raise
                now = time.monotonic()
                failed = now if failed is None else failed
                late = now - failed > RETRY_DEADLINE_S
                if not _retryable(exc) or attempt >= self.retries or late:
                    raise _named(exc, url, what, attempt + 1, self.remote.timeout) from exc
                attempt += 1
                delay = min(BACKOFF_S[1], BACKOFF_S[0] * 2**attempt)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))

    async def head(self, key: str) -> tuple[int, str]:
        """(size, ETag) of ``key``."""
        import obstore

        url = f"{self.remote.scheme}://{self.remote.bucket}/{key}"

        async def call() -> Any:
            return await obstore.head_async(self.store, key)

        meta, retries = await self._retrying(url, "HEAD", call)
        self.stats.add(0, 1 + retries, retries)
        return int(meta["size"]), str(meta.get("e_tag") or "")

    async def get(self, key: str, start: int, end: int, etag: str | None) -> Any:
        """Bytes [start, end) of ``key`` (a buffer), If-Match ``etag`` when given."""
        import obstore

        url = f"{self.remote.scheme}://{self.remote.bucket}/{key}"
        options: Any = {"range": (start, end)}  # obstore's GetOptions
        if etag:
            options["if_match"] = etag

        async def call() -> Any:
            resp = await obstore.get_async(self.store, key, options=options)
            buf = await resp.bytes_async()
            if len(buf) != end - start:
                raise ConnectionError(f"short body: {len(buf)} of {end - start} bytes")
            return buf

        buf, retries = await self._retrying(url, f"GET bytes {start}-{end - 1}", call)
        self.stats.add(end - start, 1 + retries, retries)
        return buf

    async def get_if_any(self, key: str) -> bytes | None:
        """A small object whole (config.json, the index), or None when the store answers that
        there is no such object: one request, not a HEAD first."""
        import obstore
        from obstore import exceptions as oe

        url = f"{self.remote.scheme}://{self.remote.bucket}/{key}"

        async def call() -> bytes | None:
            try:
                resp = await obstore.get_async(self.store, key)
            except (FileNotFoundError, oe.NotFoundError):
                return None
            return bytes(await resp.bytes_async())

        buf, retries = await self._retrying(url, "GET", call)
        self.stats.add(len(buf) if buf is not None else 0, 1 + retries, retries)
        return buf

    async def get_first(self, key: str, nbytes: int) -> tuple[bytes, int, str] | None:
        """The first ``nbytes`` of ``key`` (all of it when shorter) with the object's size and
        ETag from the same response: one request, and the bytes are of the version it names.
        None when the store answers 416 (an empty object has no first byte to ask for)."""
        import obstore

        url = f"{self.remote.scheme}://{self.remote.bucket}/{key}"

        async def call() -> Any:
            try:
                resp = await obstore.get_async(self.store, key, options={"range": (0, nbytes)})
            except Exception as exc:
                if _status(exc) == 416:
                    return None
                raise
            meta = resp.meta
            buf, size = bytes(await resp.bytes_async()), int(meta["size"])
            if len(buf) != min(nbytes, size):
                raise ConnectionError(f"short body: {len(buf)} of the first {nbytes} bytes of {size}")
            return buf, size, str(meta.get("e_tag") or "")

        got, retries = await self._retrying(url, f"GET bytes 0-{nbytes - 1}", call)
        self.stats.add(len(got[0]) if got else 0, 1 + retries, retries)
        return got

    async def gather(self, coros: Iterable[Awaitable[T]]) -> list[T]:
        """Every coroutine; the first failure cancels the rest (none keeps writing after it)."""
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def list_safetensors(self) -> list[str]:
        """Names of the ``*.safetensors`` objects directly under the prefix."""
        import obstore

        prefix = self.remote.prefix
        url = self.remote.url

        async def call() -> Any:
            return await obstore.list_with_delimiter_async(self.store, prefix or None)

        listing, retries = await self._retrying(url, "LIST", call)
        self.stats.add(0, 1 + retries, retries)
        names = [str(o["path"]).rsplit("/", 1)[-1] for o in listing["objects"]]
        return sorted(n for n in names if n.endswith(".safetensors"))


def _copy_out(buf: Any, targets: Sequence[tuple[int, int, int]], base: int) -> None:
    """Copies each (file offset, bytes, destination address) of ``targets`` out of ``buf``,
    which holds the file's bytes from offset ``base``."""
    view = np.frombuffer(buf, dtype=np.uint8)
    src = view.ctypes.data
    for offset, nbytes, dst in targets:
        ctypes.memmove(dst, src + (offset - base), nbytes)


def plan_requests(
    spans: np.ndarray, claim: Callable[[int, int], int | None] | None = None
) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """The requests that fetch ``spans`` (rows: file offset, bytes, destination address, room):
    spans closer than ``GAP_BYTES`` share one request, no request is over ``PIECE_BYTES``
    (a longer span is split). A wider gap joins its neighbours too when ``claim(start, end)``
    gives an address for its bytes (``GapCache``: bytes a later read wants). Each request:
    (start, end, its targets (offset, bytes, dest))."""
    out: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    rows = spans[np.argsort(spans[:, 0], kind="stable")] if len(spans) else spans
    for offset, nbytes, dst, _ in rows.tolist():
        pos = 0
        while pos < nbytes:
            a = offset + pos
            n = min(nbytes - pos, PIECE_BYTES)
            fits = bool(out) and a >= out[-1][0] and (a + n) - out[-1][0] <= PIECE_BYTES
            gap = a - out[-1][1] if out else 0
            held = claim(out[-1][1], a) if fits and gap > GAP_BYTES and claim is not None else None
            if fits and (gap <= GAP_BYTES or held is not None):
                start, end, targets = out[-1]
                if held is not None:
                    targets.append((end, gap, held))
                out[-1] = (start, max(end, a + n), targets)
                targets.append((a, n, dst + pos))
            else:
                out.append((a, a + n, [(a, n, dst + pos)]))
            pos += n
    return out


class RemoteReader:
    """A lane reader of ``ColdEngine`` over HTTP: ``read`` fetches ranges into their places.

    ``cache`` gives the engine's ``GapCache`` (None: every read fetches exactly its spans)."""

    def __init__(
        self,
        fetcher: Fetcher,
        keys: Mapping[str, tuple[str, str]],
        cache: Callable[[], GapCache | None] = lambda: None,
    ) -> None:
        self.fetcher = fetcher
        self.keys = keys  # file url -> (key, etag)
        self.cache = cache

    def read(self, path: str, ranges_ptr: int, ranges_nbytes: int, fd: int = -1) -> dict[str, Any]:
        """As ``ColdReader.read``: rows (file offset, bytes, destination, room) of int64."""
        n = ranges_nbytes // 32
        rows = np.ctypeslib.as_array((ctypes.c_int64 * (4 * n)).from_address(ranges_ptr)).reshape(n, 4)
        return self.read_many({path: rows})

    def read_many(self, spans: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Fetches the spans of several files at once (rows as ``read``'s), every request of
        every file in flight together (up to the fetcher's ``concurrency``). With a gap cache,
        spans held there are copied from it, and gaps a later read wants are fetched along."""
        before = (self.fetcher.stats.bytes, self.fetcher.stats.requests, self.fetcher.stats.retries)
        t0 = time.perf_counter()
        cache = self.cache()
        hits: dict[str, list[tuple[Held, int, int, int]]] = {}
        claims: list[Held] = []
        fetched = False
        try:
            # Claims are made while planning: from the first one on, they are settled whatever
            # happens (a lane waiting for one would otherwise wait for ever).
            work: list[Awaitable[None]] = []
            for path, rows in spans.items():
                rows = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
                claim = None
                if cache is not None:
                    rows, hits[path] = cache.split(path, rows)
                    claim = self._claimer(cache, path, claims)
                work.extend(self._requests(path, rows, claim))
            self.fetcher.run(self.fetcher.gather(work))
            fetched = True
        finally:
            if cache is not None:
                cache.settle(claims, ok=fetched)
        if cache is not None:
            # Pieces another lane claimed and failed to fetch are fetched here.
            missed = {path: cache.take(held) for path, held in hits.items() if held}
            retry = [
                request
                for path, rows in missed.items()
                if rows
                for request in self._requests(path, np.array(rows, dtype=np.int64).reshape(-1, 4))
            ]
            if retry:
                self.fetcher.run(self.fetcher.gather(retry))
        s = self.fetcher.stats
        return {
            "seconds": time.perf_counter() - t0,
            "bytes_read": 0,
            "windows": 0,
            "direct_windows": 0,
            "direct_refused": False,
            "remote_bytes": s.bytes - before[0],
            "remote_requests": s.requests - before[1],
            "remote_retries": s.retries - before[2],
        }

    def _requests(
        self, path: str, rows: np.ndarray, claim: Callable[[int, int], int | None] | None = None
    ) -> list[Awaitable[None]]:
        """The GETs that fetch ``rows`` of ``path`` into their places (``plan_requests``)."""
        key, etag = self.keys[path]
        return [
            self._get(key, etag, start, end, targets) for start, end, targets in plan_requests(rows, claim)
        ]

    @staticmethod
    def _claimer(cache: GapCache, path: str, claims: list[Held]) -> Callable[[int, int], int | None]:
        def claim(start: int, end: int) -> int | None:
            held = cache.claim(path, start, end)
            if held is None:
                return None
            claims.append(held)
            return held.address

        return claim

    async def _get(
        self, key: str, etag: str, start: int, end: int, targets: list[tuple[int, int, int]]
    ) -> None:
        buf = await self.fetcher.get(key, start, end, etag)
        _copy_out(buf, targets, start)
