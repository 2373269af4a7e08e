"""Where a remote checkpoint is and how to reach it: ``RemotePath``, ``storage_options``, the client.

``as_remote(url, storage_options)`` makes the ``RemotePath`` the loader passes around for an
object store URL (``s3://``, ``gs://``, ``az://``, ...); ``make_store`` makes (once per process,
bucket and settings) the obstore client its requests go through, with obstore's own retries off
(``remote_fetch`` counts and retries them).

Credentials, region and endpoint come from the standard environment (``AWS_*``, ``GOOGLE_*``,
``AZURE_*``: obstore reads it; ``AWS_ENDPOINT_URL`` and a named AWS profile, through boto3, are
added here) plus ``storage_options``: obstore's store config (``endpoint``, ``region``,
``access_key_id``, ...), its client options (``allow_http``, ``connect_timeout`` (10 s), ...:
``CLIENT_KEYS``) and streamload's own keys (``OWN_KEYS``: ``retries`` per request, 8;
``concurrency``, requests in flight per reader, 16; ``gap_cache_bytes``, bytes held for later
buckets, 128 MiB).

One client option changes meaning on the way. obstore's ``timeout`` bounds a whole request,
body included: on a link that delivers the requests in flight slower than their bytes over
``timeout`` (16 x 8 MiB in 30 s: about 4.5 MB/s) every request would time out, be retried and
time out again, and the load could never succeed. streamload's ``timeout`` (default 30 s)
bounds the wait for bytes instead: for the answer's first byte, then for each next read of its
body (obstore's ``read_timeout``); a request still receiving is cut only after
``REQUEST_CEILING`` (1 h). A slow link that keeps sending finishes; a connection that stops
sending fails the attempt ``timeout`` after its last byte.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointFileError

SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss")
DEFAULT_TIMEOUT = "30s"  # no byte for this long (first byte, or the body's next): the attempt fails
DEFAULT_CONNECT_TIMEOUT = "10s"
# A whole request, body included, at most: cuts only a connection that trickles (8 MiB in an hour
# is 2.3 kB/s per request, 37 kB/s for 16 in flight); one that stops is cut by ``timeout``.
REQUEST_CEILING = "1h"
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


class RemoteTimeoutError(RemoteError):
    """A request's every attempt timed out: no connection within ``connect_timeout``, or no byte
    (the answer's first, or the body's next) within ``timeout``."""


def is_remote(path: object) -> bool:
    """True for a ``scheme://...`` string of an object store streamload reads (``SCHEMES``).

    Example:
        >>> is_remote("s3://bucket/llama/"), is_remote("/data/llama")
        (True, False)
    """
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
        """The key of file ``name`` as the opening lists it (a one-file location is its own key)."""
        return self.prefix if self.is_file else self.key(name)

    def setting(self, name: str, default: int) -> int:
        """streamload's own integer option ``name`` (``OWN_KEYS``), ``default`` when not given."""
        value = dict(self.options).get(name, default)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"storage_options[{name!r}] must be an integer, not {value!r}") from None

    @property
    def timeout(self) -> str:
        """The wait for bytes this location's requests allow (``storage_options["timeout"]``), as given."""
        return str(dict(self.options).get("timeout", DEFAULT_TIMEOUT))


_INVALID = "\x00invalid"  # the key under which storage_options that are no mapping travel


def as_remote(path: Any, storage_options: Mapping[str, Any] | None = None) -> Any:
    """``path`` as a ``RemotePath`` when it is an object store URL (with ``storage_options``);
    anything else as it is. Never raises, whatever it is given (every rank calls it before the
    first agreement): storage_options that are no mapping fail where the store is opened, inside
    the load's agreement, on every rank.

    Example:
        >>> as_remote("s3://bucket/llama/", {"region": "eu-west-1"}).prefix
        'llama'
    """
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


def client_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """obstore's client options for ``storage_options``: the ``CLIENT_KEYS`` given, the timeouts'
    defaults, and ``timeout`` given to obstore as its ``read_timeout`` (the wait for the first
    byte and for each next read) with the whole request bounded by ``REQUEST_CEILING`` only.

    Example:
        >>> client_options({"timeout": "5s", "allow_http": True})["read_timeout"]
        '5s'
    """
    client = {k: v for k, v in options.items() if k in CLIENT_KEYS}
    client["read_timeout"] = client.pop("timeout", DEFAULT_TIMEOUT)
    client["timeout"] = REQUEST_CEILING
    client.setdefault("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
    return client


def _new_store(remote: RemotePath) -> Any:
    try:
        from obstore.store import from_url
    except ImportError as exc:
        raise ImportError(f"reading {remote.url} needs obstore: pip install 'streamload[remote]'") from exc
    opts = dict(remote.options)
    if _INVALID in opts:
        raise ValueError(f"storage_options must be a mapping of option names to values, not {opts[_INVALID]}")
    client = client_options(opts)
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
