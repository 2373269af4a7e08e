"""A safetensors checkpoint in object storage (``s3://``, ``gs://``, ``az://``), read by ranged GETs.

Nothing is downloaded whole and nothing is written to local disk: the table comes from
each file's 8-byte length and header (ranged GETs, validated by the same native parser
as local headers), and the stream fetches the byte spans each bucket packs, straight
into the staging ring (``RemoteEngine``, a ``ColdEngine`` whose lane readers are HTTP
range requests); gaps between them that a later bucket reads ride along and are held
until read (``GapCache``). The object store client is ``obstore`` (Rust's
``object_store``): its throughput on the same endpoint beat s3fs's (README,
``streamload bench --remote``).

Every request names the ETag the table was read from (``If-Match``): an object replaced
during the load fails the request (``RemoteObjectChangedError``) instead of mixing two
versions. Throttling, 5xx answers, timeouts, resets and short bodies are retried with
exponential backoff and jitter (``retries`` per request); what still fails is a named
error that the loader's agreements raise on every rank.

Credentials, region and endpoint come from the standard environment (``AWS_*``,
``GOOGLE_*``, ``AZURE_*``: obstore reads it) plus ``storage_options``, whose keys are
obstore's store config (``endpoint``, ``region``, ``access_key_id``, ...) and client
options (``allow_http``, ``timeout``, ...), and three of streamload's own: ``retries``
(per request, default 8; none starts 120 s after the first attempt), ``concurrency``
(requests in flight per reader, default 16) and ``gap_cache_bytes`` (bytes held for later
buckets at most, default 128 MiB; 0: none). Requests time out after 30 s (``timeout``) and
connections after 10 s (``connect_timeout``).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, TypeVar

import numpy as np

from ..errors import CheckpointError, CheckpointFileError, CheckpointIndexError, UnsafePathError
from . import _native
from .checkpoint import Checkpoint
from .cold import ColdEngine
from .gap_cache import GapCache, Held, union

T = TypeVar("T")

SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss")
INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # as the native parser's limit (csrc/header.h kMaxHeaderBytes)
HEAD_BYTES = 16 << 10  # first GET of a file: its length prefix and most headers (the rest: a second GET)
PIECE_BYTES = 8 << 20  # bytes per request at most
GAP_BYTES = 8 << 10  # spans closer than this share a request (the gap is fetched too, and may be another
# bucket's bytes: kept small, it costs at most this much per span)
# Columns of a dequantizing op row (``OpBatch.add_dequant``): weight and scale
# (file, offset, bytes, dtype), the logical dims, and the box's (start, size) per dim.
_DQ_WEIGHT, _DQ_SCALE, _DQ_DIMS, _DQ_BLOCK, _DQ_BOX = 1, 5, 12, 15, 17
DEFAULT_RETRIES = 8
DEFAULT_CONCURRENCY = 16
DEFAULT_GAP_CACHE_BYTES = 128 << 20  # bytes fetched ahead for later reads, held at most (GapCache)
BACKOFF_S = (0.05, 4.0)  # first and largest backoff
RETRY_DEADLINE_S = 120.0  # no retry starts this long after a request's first attempt
# obstore's ClientConfig keys (the rest of storage_options is the store's config).
CLIENT_KEYS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "default_headers",
        "http1_only",
        "http2_keep_alive_interval",
        "http2_keep_alive_timeout",
        "http2_keep_alive_while_idle",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_url",
        "timeout",
        "user_agent",
    }
)
OWN_KEYS = frozenset({"retries", "concurrency", "gap_cache_bytes"})


class RemoteError(CheckpointFileError):
    """An object store request failed for good (after its retries), or was refused."""


class RemoteObjectChangedError(RemoteError):
    """An object changed (ETag or size) after the table was read from it."""


def is_remote(path: object) -> bool:
    """True for a ``scheme://...`` string of an object store streamload reads (``SCHEMES``)."""
    if isinstance(path, RemotePath):
        return True
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


_SECRET = re.compile(r"secret|token|password|passwd|credential|account_key|sas|private", re.IGNORECASE)


@dataclass(frozen=True, repr=False)
class RemotePath:
    """An object store location and how to reach it (what the loader passes around for a URL).

    Attributes:
        url: ``scheme://bucket/prefix`` (a directory of safetensors files, with or without
            its index) or ``scheme://bucket/key.safetensors`` (one file).
        options: ``storage_options`` as sorted (key, value) pairs.
    """

    url: str
    options: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        """The options with their secrets masked: a traceback tool that prints locals must not log
        ``secret_access_key``, session tokens or account keys."""
        shown = tuple((k, "***" if _SECRET.search(k) else v) for k, v in self.options)
        return f"RemotePath(url={self.url!r}, options={shown!r})"

    @property
    def scheme(self) -> str:
        return self.url.partition("://")[0].lower()

    @property
    def bucket(self) -> str:
        return self.url.partition("://")[2].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        """The key under the bucket, without a trailing slash."""
        rest = self.url.partition("://")[2]
        return rest.split("/", 1)[1].strip("/") if "/" in rest else ""

    @property
    def is_file(self) -> bool:
        return self.prefix.endswith(".safetensors")

    def key(self, name: str) -> str:
        """The object key of ``name`` inside this location."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def url_of(self, name: str) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key(name)}"

    def file_key(self, name: str) -> str:
        """The key of file ``name`` as ``_resolve`` lists it (a one-file location is its own key)."""
        return self.prefix if self.is_file else self.key(name)

    def setting(self, name: str, default: int) -> int:
        value = dict(self.options).get(name, default)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"storage_options[{name!r}] must be an integer, not {value!r}") from None


_INVALID = "\x00invalid"  # the key under which storage_options that are no mapping travel


def as_remote(path: Any, storage_options: Mapping[str, Any] | None = None) -> Any:
    """``path`` as a ``RemotePath`` when it is an object store URL (with ``storage_options``);
    anything else as it is. Never raises, whatever it is given (every rank calls it before the
    first agreement): storage_options that are no mapping fail where the store is opened, inside
    the load's agreement, on every rank."""
    if isinstance(path, RemotePath) or not is_remote(path):
        return path
    try:
        options = tuple(sorted((str(k), v) for k, v in dict(storage_options or {}).items()))
    except (TypeError, ValueError):
        options = ((_INVALID, repr(storage_options)),)
    return RemotePath(str(path), options)


_STORES: dict[tuple, Any] = {}  # one client per bucket and settings in a process: connections are kept
_STORES_LOCK = threading.Lock()


def make_store(remote: RemotePath) -> Any:
    """An obstore store for ``remote``'s bucket, obstore's own retries off (ours count them).

    One per process for the same bucket, options and credential environment: the config, the
    identity check and the checkpoint reuse its connections (a fork child makes its own)."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("AWS_", "GOOGLE_", "AZURE_"))))
    key = (os.getpid(), remote.scheme, remote.bucket, repr(remote.options), env)
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = _new_store(remote)
        return _STORES[key]


def _new_store(remote: RemotePath) -> Any:
    try:
        from obstore.store import from_url
    except ImportError as exc:
        raise ImportError(f"reading {remote.url} needs obstore: pip install 'streamload[remote]'") from exc
    opts = dict(remote.options)
    if _INVALID in opts:
        raise ValueError(f"storage_options must be a mapping of option names to values, not {opts[_INVALID]}")
    client = {k: v for k, v in opts.items() if k in CLIENT_KEYS}
    client.setdefault("timeout", "30s")
    client.setdefault("connect_timeout", "10s")
    config = {k: v for k, v in opts.items() if k not in CLIENT_KEYS and k not in OWN_KEYS}
    config_keys = dict(config)
    config.pop("profile", None)
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if remote.scheme in ("s3", "s3a") and endpoint and "endpoint" not in config:
        config["endpoint"] = endpoint  # the standard variable (obstore reads AWS_ENDPOINT only)
        if endpoint.startswith("http://"):
            client.setdefault("allow_http", True)
    extra: dict[str, Any] = {}
    profile = _profile_credentials(remote, config_keys)
    if profile is not None:
        extra["credential_provider"] = profile
    try:
        build: Any = from_url  # its overloads are per scheme; the scheme is the URL's
        return build(
            f"{remote.scheme}://{remote.bucket}",
            config=config or None,
            client_options=client,
            retry_config={"max_retries": 0},
            **extra,
        )
    except Exception as exc:  # noqa: BLE001 - obstore raises its own for bad config
        raise RemoteError(f"cannot set up the object store client: {exc}", remote.url) from exc


def _profile_credentials(remote: RemotePath, config: Mapping[str, Any]) -> Any:
    """An AWS profile's credentials (``AWS_PROFILE`` or ``storage_options["profile"]``, from
    ``~/.aws/config`` and ``credentials``, SSO and role chains included) through boto3, which
    obstore does not read itself; None where keys are given or no profile is named."""
    name = config.get("profile") or os.environ.get("AWS_PROFILE")
    if remote.scheme not in ("s3", "s3a") or not name:
        return None
    if config.get("access_key_id") or os.environ.get("AWS_ACCESS_KEY_ID"):
        return None  # explicit keys win, as in every AWS SDK
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError as exc:
        raise RemoteError(f"AWS profile {name!r} needs boto3: pip install boto3", remote.url) from exc
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=str(name)))
    except Exception as exc:  # noqa: BLE001 - botocore's ProfileNotFound and config errors
        raise RemoteError(f"AWS profile {name!r}: {exc}", remote.url) from exc


# -- requests ---------------------------------------------------------------------------------
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


def _named(exc: BaseException, url: str, what: str, attempts: int) -> RemoteError:
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
        """``call()`` with retries and backoff; (its result, retries made) or a named RemoteError."""
        attempt = 0
        began = time.monotonic()
        while True:
            try:
                async with self._semaphore():
                    return await call(), attempt
            except Exception as exc:  # noqa: BLE001 - classified below
                if isinstance(exc, RemoteError):
                    raise
                late = time.monotonic() - began > RETRY_DEADLINE_S
                if not _retryable(exc) or attempt >= self.retries or late:
                    raise _named(exc, url, what, attempt + 1) from exc
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


@dataclass
class RemoteFile:
    """One safetensors object as the checkpoint's table needs it (``SafetensorsFile``'s fields)."""

    path: str  # its URL
    key: str
    etag: str
    file_size: int
    data_start: int
    tensors: list[tuple[str, str, list[int], int, int]]
    metadata: dict[str, str]
    fetcher: Fetcher = field(repr=False)
    mapped: bool = False
    fileno: int = -1

    def read_into(self, offset: int, nbytes: int, dst: int, dst_len: int) -> None:
        """Bytes [offset, offset + nbytes) of the data section to address ``dst``."""
        if nbytes > dst_len:
            raise ValueError("read_into: destination is smaller than the read")
        spans = np.array([[self.data_start + offset, nbytes, dst, nbytes]], dtype=np.int64)
        RemoteReader(self.fetcher, {self.path: (self.key, self.etag)}).read(
            self.path, spans.ctypes.data, spans.nbytes
        )

    def check_unchanged(self) -> None:
        """Nothing to ask: every GET of this object carries ``If-Match`` with the ETag its table
        was read from, so a replaced object already failed the request that would have read it
        (the stream calls this once per bucket: a HEAD per file per bucket would flood the store)."""

    def head_unchanged(self) -> None:
        """Asks the store now (one HEAD): RemoteObjectChangedError if the object was replaced."""
        size, etag = self.fetcher.run(self.fetcher.head(self.key))
        if (size, etag) != (self.file_size, self.etag):
            raise RemoteObjectChangedError(
                f"the object changed during the load (size {self.file_size} -> {size}, "
                f"ETag {self.etag} -> {etag})",
                self.path,
            )


def _safe_name(name: Any, where: str, index_url: str) -> str:
    """An index's file name, refused when it leaves the prefix (absolute, ``..``, empty)."""
    if not isinstance(name, str):
        raise CheckpointIndexError(f"file name is not a string: {name!r}", index_url)
    if not name or name.startswith(("/", "\\")) or ".." in PurePosixPath(name).parts or "://" in name:
        raise UnsafePathError(f"path {name!r} in {where} leaves the checkpoint's prefix", index_url)
    return name


async def _open_file(fetcher: Fetcher, remote: RemotePath, name: str) -> RemoteFile:
    """The length prefix and header by ranged GETs (the first names the object's size and ETag),
    validated natively."""
    key = remote.file_key(name)
    url = f"{remote.scheme}://{remote.bucket}/{key}"
    first = await fetcher.get_first(key, HEAD_BYTES)
    if first is None:  # empty: no first byte to ask for
        head, (size, etag) = b"", await fetcher.head(key)
    else:
        head, size, etag = first
    if not etag:
        raise RemoteError(
            "the store gives the object no ETag: streamload cannot make sure every request reads "
            "the same version of it",
            url,
        )
    if size < 8:
        raise CheckpointFileError(f"object of {size} bytes is too short for a safetensors header", url)
    need = 8 + int.from_bytes(head[:8], "little")
    if need > MAX_HEADER_BYTES + 8:
        raise CheckpointFileError(
            f"header length {need - 8} is over the {MAX_HEADER_BYTES} bytes allowed", url
        )
    if need > len(head) and need <= size:
        head += bytes(await fetcher.get(key, len(head), need, etag))
    try:
        tensors, metadata, data_start = _native.parse_header(head, size, url)
    except ValueError as exc:
        raise CheckpointFileError(str(exc), url) from exc
    return RemoteFile(url, key, etag, size, int(data_start), list(tensors), dict(metadata), fetcher)


async def _resolve(fetcher: Fetcher, remote: RemotePath) -> tuple[list[str], dict[str, str] | None]:
    """The files to open (names under the prefix) and the index's weight map, if any."""
    if remote.is_file:
        return [remote.prefix.rsplit("/", 1)[-1]], None
    index_url = remote.url_of(INDEX_NAME)
    raw = await fetcher.get_if_any(remote.key(INDEX_NAME))
    if raw is not None:
        try:
            weight_map = json.loads(raw)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointIndexError(f"malformed index: {exc}", index_url) from exc
        names = sorted(
            {_safe_name(f, f"the index entry for '{t}'", index_url) for t, f in weight_map.items()}
        )
        return names, {k: str(v) for k, v in weight_map.items()}
    names = await fetcher.list_safetensors()
    if not names:
        raise CheckpointError(
            "no .safetensors objects under this prefix",
            remote.url,
            hint="pass the prefix that holds model.safetensors (or its shards and index)",
        )
    return names, None


def open_remote(
    remote: RemotePath, fetcher: Fetcher | None = None
) -> tuple[list[RemoteFile], dict[str, str] | None]:
    """Opens every file of ``remote`` (headers fetched concurrently): (files, weight map)."""
    fetcher = fetcher or Fetcher(remote)

    async def go() -> tuple[list[RemoteFile], dict[str, str] | None]:
        names, weight_map = await _resolve(fetcher, remote)
        files = await fetcher.gather(_open_file(fetcher, remote, n) for n in names)
        return files, weight_map

    return fetcher.run(go())


def remote_identity(path: Any) -> tuple | None:
    """(file name, size, ETag) per object of ``path`` (a RemotePath), or None when this rank
    cannot list it: what ``readers="auto"`` compares across ranks (same bucket, key, size, ETag)."""
    if not isinstance(path, RemotePath):
        return None
    try:
        fetcher = Fetcher(path)

        async def go() -> tuple:
            names, _ = await _resolve(fetcher, path)
            heads = await fetcher.gather(fetcher.head(path.file_key(n)) for n in names)
            return tuple(
                (f"{path.bucket}/{path.file_key(n)}", s, e) for n, (s, e) in zip(names, heads, strict=True)
            )

        try:
            return fetcher.run(go()) or None
        finally:
            fetcher.close()
    except (CheckpointError, ImportError, ValueError):
        return None


def identity_soon(path: RemotePath) -> Future[tuple | None]:
    """``remote_identity(path)`` asked on a helper thread (daemon: requests, not Python work):
    a rank that does not read starts it before waiting for the reader's table, so its round
    trips overlap the reader's. ``result()`` gives what ``remote_identity`` returns, or raises."""
    future: Future[tuple | None] = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(remote_identity(path))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result
                future.set_exception(exc)

    threading.Thread(target=run, name="streamload-identity", daemon=True).start()
    return future


def opened_remote_identity(files: Sequence[Any]) -> tuple | None:
    """``remote_identity`` of the objects a RemoteCheckpoint opened (None for other files)."""
    if not files or not all(isinstance(f, RemoteFile) for f in files):
        return None
    return tuple((f"{f.path.partition('://')[2]}", f.file_size, f.etag) for f in files)


def read_small(remote: RemotePath, *names: str) -> list[bytes | None]:
    """Small objects beside the weights (``config.json``, ...) whole, each None when it is
    missing: fetched at once, one GET each."""
    fetcher = Fetcher(remote)

    async def go() -> list[bytes | None]:
        return await fetcher.gather(fetcher.get_if_any(remote.key(n)) for n in names)

    try:
        return fetcher.run(go())
    finally:
        fetcher.close()


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


class RemoteCheckpoint(Checkpoint):
    """A ``Checkpoint`` in object storage: the same table, reads and errors, by ranged GETs.

    Args:
        remote: where it is (``as_remote(url, storage_options)``).
        threads: copy threads (default: the CPUs available).

    Example:
        >>> ckpt = RemoteCheckpoint(as_remote("s3://bucket/llama/"))
        >>> w = ckpt.read("model.embed_tokens.weight")
    """

    def __init__(self, remote: RemotePath, threads: int | None = None) -> None:
        self.path = remote.url  # type: ignore[assignment]
        self.remote = remote
        self.mode = self.read_mode = "remote"
        self.fetcher = Fetcher(remote)
        files, weight_map = open_remote(remote, self.fetcher)
        self.files = files  # type: ignore[assignment]
        self.engine = RemoteEngine(_native.CopyEngine(threads or 0), files, self.fetcher)
        self._fill_table(weight_map, lambda fname, f: remote.url_of(fname) == f.path)

    def _member(self, fname: str) -> str:
        return self.remote.url_of(fname)

    def __del__(self) -> None:
        fetcher = getattr(self, "fetcher", None)
        if fetcher is not None and not sys.is_finalizing():
            fetcher.close()  # its event loop thread goes with the checkpoint

    @property
    def fetched(self) -> FetchStats:
        """Bytes, requests and retries this checkpoint fetched (headers included)."""
        return self.fetcher.stats
