"""A loopback S3 endpoint for tests and benchmarks: moto's server on 127.0.0.1.

``LocalS3`` starts ``moto.server.ThreadedMotoServer`` on a free port of 127.0.0.1 and hands out
what a client needs to reach it: ``storage_options`` for obstore, ``env`` for an SDK that reads
the standard AWS environment, and a boto3 ``client()``. moto keeps its buckets in process-global
state: two ``LocalS3`` in one process see the same buckets, and ``stop()`` deletes the buckets
this instance created so that their bytes do not outlive it.

Ranged GETs (``fast_ranges=True``, the default). moto 5 answers a ranged GET by building the
whole object: ``S3Response.get_object`` returns ``key.value``, which reads the key's entire
``SpooledTemporaryFile`` into a new ``bytes``, and only then does ``key_response`` hand it to
``_handle_range_header``, which slices out the range. An 8 MiB range of a 256 MiB object costs
about 150 ms that way, and a loader reading a multi-GB checkpoint in ranges reads it quadratically.
The patch, installed once per process on ``moto.s3.responses.S3Response``, changes exactly this:

* ``get_object``: when the request has a ``Range`` header and no ``partNumber``, the key it
  looks up (through ``_get_key``, overridden on that request's own ``S3Response`` instance only)
  is wrapped so that ``key.value`` is a ``_RangeBody``: its length is the key's size, and slicing
  it reads only the sliced bytes, position-independently (``os.pread`` on the spooled file once
  it is on disk, a slice of ``BytesIO.getbuffer()`` while in memory), under ``key.lock`` like
  moto's own ``value``. Every check before the body (ETag ``If-Match`` -> 412
  PreconditionFailed, ``If-None-Match`` -> 304, missing key -> 404 NoSuchKey, storage class,
  headers) is moto's own code, run unchanged on the real key.
* ``key_response``: moto's ``_handle_range_header`` is unchanged and slices the ``_RangeBody``
  (206, ``content-range``, suffix ranges, 416 InvalidRange). Where it answers the whole object
  instead (several ranges, an unparsable or inverted range), the wrapper turns the ``_RangeBody``
  into the full ``bytes`` before the response leaves, as unpatched moto would have.

GETs without ``Range``, HEAD, PUT, multipart uploads and every other request run moto's code
unpatched. The reads do not move the file position, so they cannot disturb moto's own
unlocked ``etag`` hashing of the same buffer.

Object bytes stay where moto puts them: in a ``SpooledTemporaryFile`` that rolls over to an
unlinked temporary file past ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE`` (5 MiB - 1 KiB). Keeping big
objects in memory instead (that variable raised before the keys are made) measured no faster
for ranged reads (within 10%, 8 MiB ranges of a 512 MiB object: both are one copy out of RAM,
the page cache or a ``BytesIO``) and would put every object in the server process's heap, so
it is not done.

moto is a test/bench extra: it is imported inside ``LocalS3`` only, and this module imports
without it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["LocalS3", "install_fast_ranges"]

_ACCESS_KEY = "test"
_SECRET_KEY = "test"
_REGION = "us-east-1"
_PATCH_MARK = "_streamload_fast_ranges"
_PATCH_LOCK = threading.Lock()


class _RangeBody:
    """A moto object's bytes, read only where sliced.

    Stands in for the ``bytes`` that ``FakeKey.value`` would return, for moto's range handling:
    ``len()`` is the object's size, ``body[a:b]`` reads bytes ``a`` to ``b`` of the key's buffer
    and nothing else, ``bytes(body)`` reads it all.
    """

    def __init__(self, key: Any) -> None:
        self._key = key

    def __len__(self) -> int:
        return int(self._key.size)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __bytes__(self) -> bytes:
        return bytes(self._key.value)

    def __getitem__(self, item: slice) -> bytes:
        if not isinstance(item, slice):
            raise TypeError("a moto object body is sliced by byte ranges only")
        start, stop, step = item.indices(len(self))
        if step != 1:
            raise ValueError("a byte range has step 1")
        return self._read(start, max(0, stop - start))

    def _read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``, without moving the buffer's file position."""
        if length == 0:
            return b""
        spooled = self._key._value_buffer
        with self._key.lock:
            inner = getattr(spooled, "_file", None)
            if getattr(spooled, "_rolled", False) and inner is not None:
                return _pread_all(inner.fileno(), offset, length)
            if inner is not None and hasattr(inner, "getbuffer"):
                with inner.getbuffer() as view:
                    return bytes(view[offset : offset + length])
            spooled.seek(offset)
            return bytes(spooled.read(length))


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of ``fd`` (short reads repeated; fewer only at EOF)."""
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


class _LazyValueKey:
    """A ``FakeKey`` whose ``value`` is a ``_RangeBody``; every other attribute is the key's."""

    def __init__(self, key: Any) -> None:
        object.__setattr__(self, "_key", key)

    @property
    def value(self) -> _RangeBody:
        return _RangeBody(self._key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._key, name)


def install_fast_ranges() -> None:
    """Make moto's ranged GETs read only the requested bytes (see the module docstring).

    Idempotent; patches ``moto.s3.responses.S3Response`` in this process only.
    """
    from moto.s3.responses import S3Response

    with _PATCH_LOCK:
        if getattr(S3Response, _PATCH_MARK, False):
            return
        original_get_object = S3Response.get_object
        original_key_response = S3Response.key_response

        def get_object(self: Any) -> Any:
            if self.headers.get("range") and "partNumber" not in self.querystring:
                moto_get_key = self._get_key

                def lazy_get_key(*args: Any, **kwargs: Any) -> tuple[Any, bool]:
                    key, not_modified = moto_get_key(*args, **kwargs)
                    return _LazyValueKey(key), not_modified

                self._get_key = lazy_get_key
            return original_get_object(self)

        def key_response(self: Any, *args: Any, **kwargs: Any) -> Any:
            status, headers, body = original_key_response(self, *args, **kwargs)
            if isinstance(body, _RangeBody):
                body = bytes(body)
            return status, headers, body

        S3Response.get_object = get_object  # type: ignore[method-assign]
        S3Response.key_response = key_response  # type: ignore[method-assign]
        setattr(S3Response, _PATCH_MARK, True)


class LocalS3:
    """moto's S3 server on a free port of 127.0.0.1, with the settings a client needs.

    Attributes:
        url: the endpoint, ``http://127.0.0.1:PORT``.
        storage_options: obstore ``S3Store`` options reaching it (``S3Store(bucket, **opts)``).
        env: the standard AWS environment variables reaching it, for SDKs that read them.

    Example:
        >>> with LocalS3() as s3:
        ...     url = s3.upload_dir("ckpt/", "models", "llama")  # "s3://models/llama/"
    """

    def __init__(self, fast_ranges: bool = True) -> None:
        """Start the server.

        Args:
            fast_ranges: patch moto so that a ranged GET reads only the range (module docstring).
        """
        from moto.server import ThreadedMotoServer

        if fast_ranges:
            install_fast_ranges()
        werkzeug_log = logging.getLogger("werkzeug")
        if werkzeug_log.level == logging.NOTSET:
            # werkzeug prints a line per request unless someone configured its logger.
            werkzeug_log.setLevel(logging.WARNING)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self._buckets: set[str] = set()
        self._client: Any = None
        self._stopped = False
        self.url = f"http://{host}:{port}"
        self.storage_options: dict[str, str] = {
            "endpoint": self.url,
            "allow_http": "true",
            "region": _REGION,
            "access_key_id": _ACCESS_KEY,
            "secret_access_key": _SECRET_KEY,
        }
        self.env: dict[str, str] = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": _ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": _SECRET_KEY,
            "AWS_REGION": _REGION,
            "AWS_DEFAULT_REGION": _REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_ALLOW_HTTP": "true",
        }

    def client(self) -> Any:
        """A boto3 S3 client for this endpoint (one per ``LocalS3``, created on first use)."""
        if self._client is None:
            import boto3

            self._client = boto3.client(
                "s3",
                endpoint_url=self.url,
                region_name=_REGION,
                aws_access_key_id=_ACCESS_KEY,
                aws_secret_access_key=_SECRET_KEY,
            )
        return self._client

    def _ensure_bucket(self, bucket: str) -> None:
        if len(bucket) < 3:
            raise ValueError(f"S3 bucket names have 3 to 63 characters: {bucket!r}")
        if bucket in self._buckets:
            return
        client = self.client()
        try:
            client.head_bucket(Bucket=bucket)
        except client.exceptions.ClientError:
            client.create_bucket(Bucket=bucket)
        self._buckets.add(bucket)

    def upload_dir(self, local_dir: str | Path, bucket: str, prefix: str) -> str:
        """Upload every regular file of ``local_dir`` (not its subfolders) under ``prefix``.

        Creates the bucket if needed; big files go up as multipart uploads (boto3's
        ``upload_file``).

        Returns:
            ``s3://bucket/prefix/`` (one trailing slash; ``s3://bucket/`` for an empty prefix).
        """
        self._ensure_bucket(bucket)
        prefix = prefix.strip("/")
        client = self.client()
        for path in sorted(Path(local_dir).iterdir()):
            if path.is_file():
                key = f"{prefix}/{path.name}" if prefix else path.name
                client.upload_file(str(path), bucket, key)
        return f"s3://{bucket}/{prefix}/" if prefix else f"s3://{bucket}/"

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` in one PUT, creating the bucket if needed."""
        self._ensure_bucket(bucket)
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def delete(self, bucket: str, key: str) -> None:
        """Delete ``key`` (no error if it is absent)."""
        self.client().delete_object(Bucket=bucket, Key=key)

    def _drop_buckets(self) -> None:
        """Delete the buckets this instance created, with their objects (moto's state is global)."""
        client = self.client()
        for bucket in sorted(self._buckets):
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for page in pages:
                keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=bucket)
        self._buckets.clear()

    def stop(self) -> None:
        """Delete this instance's buckets and stop the server (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._buckets:
                self._drop_buckets()
        finally:
            self._server.stop()
            wsgi = getattr(self._server, "_server", None)
            if wsgi is not None:
                wsgi.server_close()

    def __enter__(self) -> LocalS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
