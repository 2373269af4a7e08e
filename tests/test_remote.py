"""streamload.io.remote and its stages (remote_store, remote_fetch) in one process: URLs, request
planning, retry classification, timeouts, and checkpoints in a loopback S3 endpoint read as local
ones are (table, reads, bad files)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from streamload.errors import CheckpointError, CheckpointFileError, UnsafePathError
from streamload.io.checkpoint import Checkpoint
from streamload.io.remote import (
    GAP_BYTES,
    PIECE_BYTES,
    RemoteCheckpoint,
    RemotePath,
    as_remote,
    is_remote,
    make_store,
    plan_requests,
)
from streamload.io.remote_fetch import _retryable

pytest.importorskip("obstore")
pytest.importorskip("moto")

from streamload.tools.bench.s3 import LocalS3  # noqa: E402

BUCKET = "unit"


def test_urls() -> None:
    assert is_remote("s3://b/p") and is_remote("gs://b/p") and is_remote("az://c/p")
    assert not is_remote("/local/dir") and not is_remote("file:///x") and not is_remote(Path("s3:/x"))
    r = as_remote("s3://bucket/some/prefix/", {"region": "us-east-1"})
    assert isinstance(r, RemotePath) and as_remote(r) is r
    assert (r.bucket, r.prefix, r.key("a.safetensors")) == (
        "bucket",
        "some/prefix",
        "some/prefix/a.safetensors",
    )
    one = as_remote("s3://bucket/dir/model.safetensors")
    assert one.is_file and one.file_key("model.safetensors") == "dir/model.safetensors"
    assert as_remote("/local") == "/local"
    with pytest.raises(ValueError, match="retries"):
        as_remote("s3://b/p", {"retries": "many"}).setting("retries", 8)
    # Never raises (every rank calls it before the first agreement): a bad value fails at the store.
    for bad in (["not", "a", "mapping"], 3, {1: object()}, {"default_headers": {"a": "b"}}):
        r = as_remote("s3://b/p", bad)  # type: ignore[arg-type]
        assert isinstance(r, RemotePath)
    with pytest.raises(ValueError, match="storage_options must be a mapping"):
        make_store(as_remote("s3://b/p", 3))  # type: ignore[arg-type]


def test_plan_requests_cover_every_span_once() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        offsets = np.sort(rng.integers(0, 64 << 20, n))
        lengths = rng.integers(1, 12 << 20, n)
        dest = np.cumsum(np.concatenate([[0], lengths[:-1]])) + (1 << 40)
        spans = np.stack([offsets, lengths, dest, lengths], axis=1).astype(np.int64)
        requests = plan_requests(spans)
        covered: dict[int, int] = {}
        for start, end, targets in requests:
            assert 0 < end - start <= PIECE_BYTES
            for off, nb, dst in targets:
                assert start <= off and off + nb <= end
                covered[dst] = nb
        # Every destination byte is written by exactly one target piece.
        for _off, nb, dst, _ in spans.tolist():
            got = sum(v for k, v in covered.items() if dst <= k < dst + nb)
            assert got == nb
        # A gap fetched inside a request is at most GAP_BYTES.
        for _start, _end, targets in requests:
            ends = sorted((o, o + n) for o, n, _ in targets)
            reach = ends[0][1]
            for o, e in ends[1:]:
                assert o - reach <= GAP_BYTES
                reach = max(reach, e)


def test_retry_classification() -> None:
    from obstore import exceptions as oe

    assert _retryable(oe.GenericError("Server returned non-2xx status code: 503 Service Unavailable"))
    assert _retryable(oe.GenericError("Server returned non-2xx status code: 429 Too Many Requests"))
    assert _retryable(ConnectionError("short body"))
    assert not _retryable(oe.GenericError("Server returned non-2xx status code: 400 Bad Request"))
    assert not _retryable(FileNotFoundError("gone"))
    assert not _retryable(oe.PreconditionError("etag"))


@pytest.fixture(scope="module")
def s3():
    with LocalS3() as server:
        yield server


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g),
        "c": torch.randint(-100, 100, (5, 3), generator=g, dtype=torch.int32),
    }


def test_table_and_reads_equal_the_local_checkpoint(s3: LocalS3, tmp_path: Path) -> None:
    save_file(_tensors(), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    url = s3.upload_dir(tmp_path, BUCKET, "plain")
    local = Checkpoint(tmp_path)
    remote = RemoteCheckpoint(as_remote(url, s3.storage_options))
    assert remote.read_mode == "remote"
    assert [(t.name, t.dtype, t.shape, t.begin, t.nbytes) for t in remote.tensors] == [
        (t.name, t.dtype, t.shape, t.begin, t.nbytes) for t in local.tensors
    ]
    assert remote.metadata[remote.files[0].path] == {"format": "pt"}
    for name in local:
        assert torch.equal(remote.read(name), local.read(name))
        assert torch.equal(remote.read_bytes(name), local.read_bytes(name))
    assert torch.equal(remote.read_region("a", [(3, 9), (5, 40)]), local.read_region("a", [(3, 9), (5, 40)]))
    remote.files[0].head_unchanged()
    s3.put(BUCKET, "plain/model.safetensors", (tmp_path / "model.safetensors").read_bytes() + b" ")
    with pytest.raises(CheckpointFileError, match="changed during the load"):
        remote.files[0].head_unchanged()
    remote.check_unchanged()  # asks nothing: the requests themselves name the ETag
    with pytest.raises(CheckpointFileError, match="changed during the load"):
        remote.read("a")  # If-Match: 412


def _upload_bytes(s3: LocalS3, prefix: str, data: bytes) -> str:
    s3.put(BUCKET, f"{prefix}/model.safetensors", data)
    return f"s3://{BUCKET}/{prefix}/"


def test_bad_files_are_named_errors(s3: LocalS3, tmp_path: Path) -> None:
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    good = (tmp_path / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", good[:8])[0]
    header = json.loads(good[8 : 8 + n])
    cases = {
        "truncated": good[: 8 + n + 10],  # data shorter than the header says
        "short": good[:5],
        "empty": b"",  # no first byte to ask for (416): a HEAD gives its size
        "huge_header": struct.pack("<Q", 1 << 40) + good[8:],
    }
    lying = dict(header)
    lying["a"] = {**header["a"], "data_offsets": [0, 10]}  # not its shape's size
    text = json.dumps(lying).encode()
    cases["lying_offsets"] = struct.pack("<Q", len(text)) + text + good[8 + n :]
    for name, data in cases.items():
        url = _upload_bytes(s3, f"bad_{name}", data)
        with pytest.raises(CheckpointError) as info:
            RemoteCheckpoint(as_remote(url, s3.storage_options))
        assert f"bad_{name}/model.safetensors" in str(info.value), (name, info.value)


def test_index_and_listing(s3: LocalS3, tmp_path: Path) -> None:
    t = _tensors()
    save_file({"a": t["a"]}, str(tmp_path / "one.safetensors"))
    save_file({"b": t["b"], "c": t["c"]}, str(tmp_path / "two.safetensors"))
    # No index: every *.safetensors under the prefix.
    url = s3.upload_dir(tmp_path, BUCKET, "listed")
    assert sorted(RemoteCheckpoint(as_remote(url, s3.storage_options)).keys()) == ["a", "b", "c"]
    # An index that maps a tensor to a file that does not hold it.
    index = {"weight_map": {"a": "two.safetensors", "b": "two.safetensors", "c": "two.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    url = s3.upload_dir(tmp_path, BUCKET, "wrong_index")
    with pytest.raises(CheckpointError, match="does not hold it"):
        RemoteCheckpoint(as_remote(url, s3.storage_options))
    index["weight_map"]["a"] = "/abs/one.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    url = s3.upload_dir(tmp_path, BUCKET, "abs_index")
    with pytest.raises(UnsafePathError):
        RemoteCheckpoint(as_remote(url, s3.storage_options))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    url = s3.upload_dir(tmp_path, BUCKET, "broken_index")
    with pytest.raises(CheckpointError, match="malformed index"):
        RemoteCheckpoint(as_remote(url, s3.storage_options))


def test_aws_profile(s3: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials from a named profile of the shared files (obstore reads none itself)."""
    from streamload.io.remote_store import RemoteError, _profile_credentials

    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    url = s3.upload_dir(tmp_path, BUCKET, "profiled")
    creds = tmp_path / "credentials"
    creds.write_text("[streamload-test]\naws_access_key_id = AKIAPROFILE\naws_secret_access_key = s3cr3t\n")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no_config"))
    monkeypatch.setenv("AWS_PROFILE", "streamload-test")
    options = {k: v for k, v in s3.storage_options.items() if k not in ("access_key_id", "secret_access_key")}
    remote = as_remote(url, options)
    provider = _profile_credentials(remote, options)
    assert provider is not None and provider()["access_key_id"] == "AKIAPROFILE"
    assert torch.equal(RemoteCheckpoint(remote).read("b"), _tensors()["b"])
    # Explicit keys win over the profile; a profile that does not exist is a named error.
    assert _profile_credentials(remote, {**options, "access_key_id": "x"}) is None
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(RemoteError, match="no-such-profile"):
        _profile_credentials(as_remote(url, options), options)


def test_open_asks_one_request_per_object(s3: LocalS3, tmp_path: Path) -> None:
    """Opening costs round trips, which a real endpoint makes tens of milliseconds each: the
    index is one GET (no HEAD first), each file's length prefix and header one ranged GET whose
    response names the object's size and ETag, and ``from_pretrained``'s two configs are asked
    at once, a missing one answered by its 404."""
    from s3_proxy import FaultProxy

    from streamload.io.remote import read_small

    t = _tensors()
    save_file({"a": t["a"]}, str(tmp_path / "one.safetensors"))
    save_file({"b": t["b"], "c": t["c"]}, str(tmp_path / "two.safetensors"))
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors", "c": "two.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    url = s3.upload_dir(tmp_path, BUCKET, "round_trips")
    with FaultProxy(s3.url) as proxy:
        remote = as_remote(url, {**s3.storage_options, "endpoint": proxy.url})
        ckpt = RemoteCheckpoint(remote)
        assert sorted(ckpt.keys()) == ["a", "b", "c"]
        assert [m for m, _, _ in proxy.log] == ["GET"] * 3
        assert [f.file_size for f in ckpt.files] == [
            (tmp_path / n).stat().st_size for n in ("one.safetensors", "two.safetensors")
        ]
        assert all(f.etag for f in ckpt.files)
        before = len(proxy.log)
        config, generation = read_small(remote, "config.json", "generation_config.json")
        assert config == b'{"model_type": "llama"}' and generation is None
        assert [(m, outcome) for m, _, outcome in proxy.log[before:]] in (
            [("GET", 200), ("GET", 404)],
            [("GET", 404), ("GET", 200)],
        )


def test_empty_object_and_failures_on_odd_keys(s3: LocalS3, tmp_path: Path) -> None:
    """An empty object answers the first ranged GET with 416: its size then comes from a HEAD and
    it is "too short"; a store failure on a key that happens to contain "416" stays a store
    failure (the status is read from the answer, not from the message's text)."""
    from s3_proxy import FaultProxy

    with FaultProxy(s3.url) as proxy:
        options = {**s3.storage_options, "endpoint": proxy.url, "retries": 0}
        url = _upload_bytes(s3, "empty_object", b"")
        with pytest.raises(CheckpointFileError, match="0 bytes is too short"):
            RemoteCheckpoint(as_remote(url, options))
        # the index (none), the listing, the first bytes (416), the HEAD
        assert [(m, outcome) for m, _, outcome in proxy.log] == [
            ("GET", 404),
            ("GET", 200),
            ("GET", 416),
            ("HEAD", 200),
        ]
        save_file(_tensors(), str(tmp_path / "model.safetensors"))
        url = _upload_bytes(s3, "checkpoint-41600", (tmp_path / "model.safetensors").read_bytes())
        proxy.fail("500", match="checkpoint-41600/model.safetensors", times=5)
        with pytest.raises(CheckpointFileError, match="failed after 1 attempt") as info:
            RemoteCheckpoint(as_remote(url, options))
        assert "header" not in str(info.value), info.value


def test_repr_masks_secrets() -> None:
    """A traceback tool that prints locals must not log credentials."""
    from streamload.io.remote import RemotePath

    opts = (("access_key_id", "AKIA"), ("secret_access_key", "s3cr3t"), ("session_token", "tok"), ("region", "r"))
    shown = repr(RemotePath("s3://b/p", opts))
    assert "s3cr3t" not in shown and "tok'" not in shown and "AKIA" in shown and "'r'" in shown


def test_access_denied_is_told_by_the_status_not_the_key() -> None:
    """A 503 on a key that contains 403 is a store failure; a 403 response is access denied."""
    from streamload.io.remote_fetch import _named

    busy = _named(RuntimeError("request to s3://b/ckpt-403/x failed, status code: 503 Unavailable"), "u", "GET", 8)
    assert "access denied" not in str(busy) and "after 8 attempt" in str(busy)
    denied = _named(RuntimeError("Generic S3 error: status code: 403 Forbidden"), "u", "GET", 1)
    assert "access denied" in str(denied) and "credentials" in str(denied)


def test_timeout_bounds_the_wait_for_bytes_not_the_body() -> None:
    """``storage_options["timeout"]`` goes to obstore as its ``read_timeout`` (first byte, then each
    next read); obstore's whole-request ``timeout`` is only the 1 h ceiling."""
    from streamload.io.remote_store import REQUEST_CEILING, client_options

    assert client_options({}) == {"read_timeout": "30s", "timeout": REQUEST_CEILING, "connect_timeout": "10s"}
    got = client_options({"timeout": "5s", "connect_timeout": "2s", "allow_http": True, "region": "r"})
    assert got == {"read_timeout": "5s", "timeout": REQUEST_CEILING, "connect_timeout": "2s", "allow_http": True}
    assert as_remote("s3://b/p", {"timeout": "5s"}).timeout == "5s" and as_remote("s3://b/p").timeout == "30s"


def _slow_link_checkpoint(s3: LocalS3, tmp_path: Path, prefix: str) -> tuple[str, torch.Tensor]:
    """One 256 KiB tensor: a body that takes seconds at the proxy's slow rates."""
    w = torch.arange(64 << 10, dtype=torch.float32)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    return _upload_bytes(s3, prefix, (tmp_path / "model.safetensors").read_bytes()), w


def test_slow_body_is_not_a_timeout(s3: LocalS3, tmp_path: Path) -> None:
    """``timeout`` bounds the wait for bytes, not the whole body: every GET of the object is sent
    at 100 kB/s (its data request, 256 KiB, takes 2.6 s, its header one 0.2 s) under a 1 s
    ``timeout``; the bytes keep flowing, so the read succeeds, exact and with no retry. Before,
    ``timeout`` bounded each request's whole body: every attempt timed out, and the read failed
    ("failed after 3 attempt(s)") though the link was healthy, only slow."""
    import time

    from s3_proxy import FaultProxy

    url, w = _slow_link_checkpoint(s3, tmp_path, "slow_body")
    with FaultProxy(s3.url) as proxy:
        proxy.fail("slow:100000", times=100, match="slow_body/model.safetensors")
        options = {**s3.storage_options, "endpoint": proxy.url, "timeout": "1s", "retries": 2}
        t0 = time.monotonic()
        ckpt = RemoteCheckpoint(as_remote(url, options))
        got = ckpt.read("w")
        took = time.monotonic() - t0
    assert torch.equal(got, w)
    slow = [path for _, path, kind in proxy.log if str(kind).startswith("slow")]
    assert slow.count(f"/{BUCKET}/slow_body/model.safetensors") == 2, proxy.log  # header and data
    assert ckpt.fetched.retries == 0 and 2.0 < took < 10, (ckpt.fetched, took)


def test_stalled_body_is_a_named_timeout(s3: LocalS3, tmp_path: Path) -> None:
    """An answer that sends half its body and then nothing (the connection kept open) fails its
    attempt once no byte came for ``timeout``; retried, it ends as ``RemoteTimeoutError`` naming
    the object, the range and the timeout, in bounded time: here 1 s per attempt, 2 attempts."""
    import time

    from s3_proxy import FaultProxy

    from streamload.io.remote import RemoteError, RemoteTimeoutError

    url, _ = _slow_link_checkpoint(s3, tmp_path, "stalled_body")
    with FaultProxy(s3.url) as proxy:
        options = {**s3.storage_options, "endpoint": proxy.url, "timeout": "1s", "retries": 1}
        ckpt = RemoteCheckpoint(as_remote(url, options))
        proxy.fail("stall", times=100, match="stalled_body/model.safetensors")
        t0 = time.monotonic()
        with pytest.raises(RemoteTimeoutError, match=r"after 2 attempt\(s\).*no byte for 1s") as info:
            ckpt.read("w")
        took = time.monotonic() - t0
    assert isinstance(info.value, RemoteError) and "stalled_body/model.safetensors" in str(info.value)
    assert proxy.faults == 2 and 2.0 <= took < 6, (proxy.log, took)


def test_timeouts_are_told_by_the_transport_not_the_key() -> None:
    """A timeout (no status answered) is a RemoteTimeoutError naming the wait; an answered 503 on
    a key that happens to hold the word is a store failure."""
    from streamload.io.remote_fetch import _named
    from streamload.io.remote_store import RemoteTimeoutError

    cut = RuntimeError("Generic S3 error: HTTP error: request or response body error\n  kind: Timeout,\n")
    err = _named(cut, "u", "GET bytes 0-9", 3, "5s")
    assert isinstance(err, RemoteTimeoutError) and "no byte for 5s" in str(err), err
    busy = RuntimeError("GET s3://b/TimedOut/x failed, status code: 503 Unavailable (kind: Timeout)")
    assert not isinstance(_named(busy, "u", "GET", 8), RemoteTimeoutError)
