"""A safetensors checkpoint in object storage (``s3://``, ``gs://``, ``az://``), read by ranged GETs.

Nothing is downloaded whole and nothing is written to local disk: the table comes from
each file's 8-byte length and header (ranged GETs, validated by the same native parser
as local headers), and the stream fetches the byte spans each bucket packs, straight
into the staging ring (``RemoteEngine``, a ``ColdEngine`` whose lane readers are HTTP
range requests). The object store client is ``obstore`` (Rust's ``object_store``): its
throughput on the same endpoint beat s3fs's (README, ``streamload bench --remote``).

Every request names the ETag the table was read from (``If-Match``): an object replaced
during the load fails the request (``RemoteObjectChangedError``) instead of mixing two
versions. What still fails after its retries is a named error that the loader's
agreements raise on every rank.

The stages, one module each:

* ``remote_store``: the location (``RemotePath``, ``as_remote``), ``storage_options`` and
  the client (``make_store``): credentials, endpoint, timeouts.
* ``remote_fetch``: the requests (``Fetcher``: concurrency, retries, named errors), their
  plan (``plan_requests``) and the lane reader (``RemoteReader``).
* ``remote_engine``: the copy engine over them (``RemoteEngine``).
* here: opening the objects (index, listing, headers), the views ranks compare
  (``remote_identity``), small side objects (``read_small``) and ``RemoteCheckpoint``.
  The names other modules use from the stages are importable from here too.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from ..errors import CheckpointError, CheckpointFileError, CheckpointIndexError, UnsafePathError
from . import _native
from .checkpoint import Checkpoint
from .remote_engine import RemoteEngine
from .remote_fetch import GAP_BYTES, PIECE_BYTES, Fetcher, FetchStats, RemoteReader, plan_requests
from .remote_store import (
    RemoteError,
    RemoteObjectChangedError,
    RemotePath,
    RemoteTimeoutError,
    as_remote,
    is_remote,
    make_store,
)

__all__ = [
    "GAP_BYTES",
    "PIECE_BYTES",
    "FetchStats",
    "Fetcher",
    "RemoteCheckpoint",
    "RemoteEngine",
    "RemoteError",
    "RemoteFile",
    "RemoteObjectChangedError",
    "RemotePath",
    "RemoteReader",
    "RemoteTimeoutError",
    "as_remote",
    "identity_soon",
    "is_remote",
    "make_store",
    "open_remote",
    "opened_remote_identity",
    "plan_requests",
    "read_small",
    "remote_identity",
]

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # as the native parser's limit (csrc/header.h kMaxHeaderBytes)
HEAD_BYTES = 16 << 10  # first GET of a file: its length prefix and most headers (the rest: a second GET)


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
