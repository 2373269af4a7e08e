"""The loopback S3 endpoint (LocalS3, moto's server) and the test fault proxy, single process.

LocalS3 must answer what obstore and boto3 ask of S3: ranges (explicit, open, suffix), If-Match,
missing keys, HEAD; with ``fast_ranges`` its ranged GETs must answer exactly what moto's own
range handling answers, without reading the whole object. FaultProxy must inject each fault kind
so that a client without retries sees it, and only on the requests it was aimed at.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")
botocore_config = pytest.importorskip("botocore.config")
obstore = pytest.importorskip("obstore")

from obstore.exceptions import PreconditionError  # noqa: E402
from obstore.store import S3Store  # noqa: E402
from s3_proxy import FaultProxy  # noqa: E402

from streamload.tools.bench.s3 import LocalS3, install_fast_ranges  # noqa: E402

BUCKET = "streamload-test"
SMALL = 1 << 20  # stays in moto's in-memory spool
BIG = 12 << 20  # rolls over to moto's temporary file; multipart through upload_file


def _blob(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture(scope="module")
def s3_upload(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One LocalS3 with a small and a big object uploaded by ``upload_dir``, and its answer."""
    src = tmp_path_factory.mktemp("s3src")
    (src / "small.bin").write_bytes(_blob(SMALL, 1))
    (src / "big.bin").write_bytes(_blob(BIG, 2))
    (src / "sub").mkdir()
    (src / "sub" / "ignored.bin").write_bytes(b"x")
    with LocalS3() as server:
        yield server, server.upload_dir(src, BUCKET, "ckpt")


@pytest.fixture(scope="module")
def s3(s3_upload: tuple[LocalS3, str]) -> LocalS3:
    return s3_upload[0]


@pytest.fixture(scope="module")
def store(s3: LocalS3) -> S3Store:
    return S3Store(BUCKET, **s3.storage_options)


def _no_retry_store(endpoint: str, s3: LocalS3) -> S3Store:
    retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=10)}
    return S3Store(BUCKET, **{**s3.storage_options, "endpoint": endpoint}, retry_config=retry)


def _boto(endpoint: str, retries: int = 0) -> Any:
    config = botocore_config.Config(retries={"total_max_attempts": retries + 1, "mode": "standard"})
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=config,
    )


# ---- LocalS3 --------------------------------------------------------------------------------


def test_upload_dir_uploads_the_regular_files(
    s3_upload: tuple[LocalS3, str], store: S3Store, tmp_path: Path
) -> None:
    s3, url = s3_upload
    assert url == f"s3://{BUCKET}/ckpt/"
    keys = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET)["Contents"])
    assert keys == ["ckpt/big.bin", "ckpt/small.bin"]
    assert bytes(obstore.get(store, "ckpt/big.bin").bytes()) == _blob(BIG, 2)
    # The big file went up in parts (S3's multipart ETag ends in -<parts>).
    assert s3.client().head_object(Bucket=BUCKET, Key="ckpt/big.bin")["ETag"].endswith('-2"')
    (tmp_path / "f.txt").write_bytes(b"abc")
    assert s3.upload_dir(tmp_path, "other-bucket", "/a/b/") == "s3://other-bucket/a/b/"
    assert s3.client().get_object(Bucket="other-bucket", Key="a/b/f.txt")["Body"].read() == b"abc"
    with pytest.raises(ValueError, match="3 to 63"):
        s3.put("ab", "k", b"")


def test_env_and_storage_options_reach_it(s3: LocalS3) -> None:
    assert s3.storage_options["endpoint"] == s3.url == s3.env["AWS_ENDPOINT_URL"]
    assert s3.url.startswith("http://127.0.0.1:")
    assert s3.env["AWS_EC2_METADATA_DISABLED"] == "true"


@pytest.mark.parametrize("name,size,seed", [("small.bin", SMALL, 1), ("big.bin", BIG, 2)])
def test_obstore_ranges(store: S3Store, name: str, size: int, seed: int) -> None:
    data = _blob(size, seed)
    path = f"ckpt/{name}"
    assert bytes(obstore.get_range(store, path, start=3, end=size // 2 + 7)) == data[3 : size // 2 + 7]
    assert bytes(obstore.get_range(store, path, start=size - 10, length=100)) == data[-10:]
    suffix = obstore.get(store, path, options={"range": {"suffix": 4097}}).bytes()
    assert bytes(suffix) == data[-4097:]
    tail = obstore.get(store, path, options={"range": {"offset": size - 5000}}).bytes()
    assert bytes(tail) == data[-5000:]
    many = obstore.get_ranges(store, path, starts=[0, 100, size - 1], ends=[10, 1000, size])
    assert [bytes(b) for b in many] == [data[0:10], data[100:1000], data[-1:]]


def test_head_if_match_and_missing(s3: LocalS3, store: S3Store) -> None:
    meta = obstore.head(store, "ckpt/small.bin")
    assert meta["size"] == SMALL
    assert meta["e_tag"] == s3.client().head_object(Bucket=BUCKET, Key="ckpt/small.bin")["ETag"]
    options: dict[str, Any] = {"if_match": meta["e_tag"], "range": (0, 16)}
    assert bytes(obstore.get(store, "ckpt/small.bin", options=options).bytes()) == _blob(SMALL, 1)[:16]
    with pytest.raises(PreconditionError):
        obstore.get(store, "ckpt/small.bin", options={"if_match": '"0123"', "range": (0, 16)})
    with pytest.raises(FileNotFoundError):
        obstore.get_range(store, "ckpt/absent.bin", start=0, end=4)
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "ckpt/absent.bin")


def test_put_and_delete(s3: LocalS3, store: S3Store) -> None:
    s3.put(BUCKET, "scratch/k", b"payload")
    assert bytes(obstore.get(store, "scratch/k").bytes()) == b"payload"
    s3.delete(BUCKET, "scratch/k")
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "scratch/k")


def _moto_answer(header: str, data: bytes) -> tuple[int, bytes, str | None]:
    """What moto's own ``_handle_range_header`` answers for ``header`` on the whole object."""
    from moto.s3.exceptions import InvalidRange
    from moto.s3.responses import S3Response

    class _Request:
        method = "GET"
        headers = {"range": header}

    try:
        status, headers, body = S3Response()._handle_range_header(
            _Request(), {"content-length": str(len(data))}, data
        )
    except InvalidRange:
        return 416, b"", None
    return status, bytes(body), headers.get("content-range")


def _served(client: Any, key: str, header: str) -> tuple[int, bytes, str | None]:
    try:
        got = client.get_object(Bucket=BUCKET, Key=key, Range=header)
    except client.exceptions.ClientError as err:
        return err.response["ResponseMetadata"]["HTTPStatusCode"], b"", None
    return got["ResponseMetadata"]["HTTPStatusCode"], got["Body"].read(), got.get("ContentRange")


@pytest.mark.parametrize("name,size,seed", [("small.bin", SMALL, 1), ("big.bin", BIG, 2)])
def test_fast_ranges_answer_what_moto_answers(s3: LocalS3, name: str, size: int, seed: int) -> None:
    data = _blob(size, seed)
    rng = random.Random(seed)
    headers = [f"bytes={a}-{a + rng.randrange(1 << 16)}" for a in rng.sample(range(size), 12)]
    headers += [f"bytes=-{rng.randrange(1, size)}" for _ in range(4)]
    headers += [f"bytes={rng.randrange(size)}-" for _ in range(4)]
    headers += ["bytes=0-0", f"bytes={size - 1}-", f"bytes=-{size + 5}", f"bytes=10-{size * 2}"]
    headers += ["bytes=50-40", "bytes=0-1,5-6", f"bytes={size}-", "bytes=-0", "bytes=x-y"]
    client = s3.client()
    for header in headers:
        assert _served(client, f"ckpt/{name}", header) == _moto_answer(header, data), header


def test_fast_ranges_do_not_read_the_whole_object(s3: LocalS3, monkeypatch: pytest.MonkeyPatch) -> None:
    from moto.s3.models import FakeKey

    install_fast_ranges()  # idempotent: already installed by the fixture
    whole_reads = []
    moto_value = FakeKey.value

    def counted(key: Any) -> bytes:
        whole_reads.append(key.name)
        return moto_value.fget(key)

    monkeypatch.setattr(FakeKey, "value", property(counted, moto_value.fset))
    client = s3.client()
    assert (
        client.get_object(Bucket=BUCKET, Key="ckpt/big.bin", Range="bytes=5-9")["Body"].read()
        == _blob(BIG, 2)[5:10]
    )
    assert whole_reads == []
    client.get_object(Bucket=BUCKET, Key="ckpt/big.bin")["Body"].read()
    assert whole_reads == ["ckpt/big.bin"]


def test_ranged_throughput_sanity(s3: LocalS3, store: S3Store) -> None:
    """8 MiB ranges, 8 in flight, over the big object four times (prints MiB/s; no timing assert)."""
    data = _blob(BIG, 2)
    step = 8 << 20
    offsets = [o for _ in range(4) for o in range(0, BIG, step)]

    async def read_all() -> list[bytes]:
        gate = asyncio.Semaphore(8)

        async def one(offset: int) -> bytes:
            async with gate:
                got = await obstore.get_range_async(
                    store, "ckpt/big.bin", start=offset, length=min(step, BIG - offset)
                )
                return bytes(got)

        return await asyncio.gather(*(one(o) for o in offsets))

    start = time.perf_counter()
    chunks = asyncio.run(read_all())
    elapsed = time.perf_counter() - start
    assert all(c == data[o : o + step] for o, c in zip(offsets, chunks, strict=True))
    print(f"LocalS3 ranged GET: {sum(map(len, chunks)) / elapsed / 2**20:.0f} MiB/s")


# ---- FaultProxy -----------------------------------------------------------------------------


@pytest.fixture
def proxy(s3: LocalS3) -> Any:
    with FaultProxy(s3.url) as p:
        yield p


def test_proxy_forwards_signed_requests(s3: LocalS3, proxy: FaultProxy, tmp_path: Path) -> None:
    client = _boto(proxy.url)
    client.put_object(Bucket=BUCKET, Key="via-proxy/k", Body=b"signed")
    big = tmp_path / "big.bin"
    big.write_bytes(_blob(9 << 20, 3))
    client.upload_file(str(big), BUCKET, "via-proxy/big")  # multipart: POST, PUT parts, POST
    assert s3.client().get_object(Bucket=BUCKET, Key="via-proxy/big")["Body"].read() == big.read_bytes()
    head = client.head_object(Bucket=BUCKET, Key="via-proxy/k")
    assert head["ContentLength"] == 6
    store = _no_retry_store(proxy.url, s3)
    assert bytes(obstore.get_range(store, "via-proxy/k", start=1, end=4)) == b"ign"
    assert bytes(obstore.get(store, "ckpt/big.bin").bytes()) == _blob(BIG, 2)
    methods = {m for m, _, _ in proxy.log}
    assert {"PUT", "POST", "HEAD", "GET"} <= methods
    assert proxy.faults == 0 and proxy.requests == len(proxy.log)


@pytest.mark.parametrize("kind", ["500", "503", "reset", "truncate"])
def test_obstore_sees_each_fault(s3: LocalS3, proxy: FaultProxy, kind: str) -> None:
    store = _no_retry_store(proxy.url, s3)
    proxy.fail(kind, match="big.bin")
    with pytest.raises(Exception) as err:  # noqa: B017 (obstore's error for each kind differs)
        bytes(obstore.get_range(store, "ckpt/big.bin", start=0, end=4 << 20))
    if kind in ("500", "503"):
        assert f"{kind} " in str(err.value)
    assert proxy.faults == 1
    assert proxy.log[-1] == ("GET", f"/{BUCKET}/ckpt/big.bin", kind)
    assert bytes(obstore.get_range(store, "ckpt/big.bin", start=0, end=16)) == _blob(BIG, 2)[:16]


@pytest.mark.parametrize("kind,error", [("500", "InternalError"), ("503", "SlowDown")])
def test_boto3_sees_error_statuses(proxy: FaultProxy, kind: str, error: str) -> None:
    client = _boto(proxy.url)
    proxy.fail(kind)
    with pytest.raises(client.exceptions.ClientError) as err:
        client.get_object(Bucket=BUCKET, Key="ckpt/small.bin", Range="bytes=0-9")
    assert err.value.response["Error"]["Code"] == error
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == int(kind)


def test_boto3_sees_reset_and_truncate(proxy: FaultProxy) -> None:
    from botocore.exceptions import ConnectionClosedError, ResponseStreamingError

    client = _boto(proxy.url)
    proxy.fail("reset")
    with pytest.raises(ConnectionClosedError):
        client.get_object(Bucket=BUCKET, Key="ckpt/small.bin", Range="bytes=0-9")
    proxy.fail("truncate")
    body = client.get_object(Bucket=BUCKET, Key="ckpt/small.bin")["Body"]
    with pytest.raises(ResponseStreamingError):
        body.read()
    assert [k for _, _, k in proxy.log] == ["reset", "truncate"]


def test_delay_then_forward(s3: LocalS3, proxy: FaultProxy) -> None:
    store = _no_retry_store(proxy.url, s3)
    client = _boto(proxy.url)
    proxy.fail("delay:0.3", times=2)
    start = time.perf_counter()
    assert bytes(obstore.get_range(store, "ckpt/small.bin", start=0, end=8)) == _blob(SMALL, 1)[:8]
    assert (
        client.get_object(Bucket=BUCKET, Key="ckpt/small.bin", Range="bytes=0-7")["Body"].read()
        == _blob(SMALL, 1)[:8]
    )
    assert time.perf_counter() - start >= 0.6
    assert [k for _, _, k in proxy.log] == ["delay:0.3", "delay:0.3"] and proxy.faults == 2


def test_times_match_after_and_method(proxy: FaultProxy) -> None:
    client = _boto(proxy.url)
    proxy.fail("503", times=2, match="big.bin", after=1)
    proxy.fail("500", method="PUT")

    def get(key: str) -> int | str:
        try:
            client.get_object(Bucket=BUCKET, Key=key, Range="bytes=0-0")
        except client.exceptions.ClientError as err:
            return err.response["Error"]["Code"]
        return "ok"

    outcomes = [get("ckpt/small.bin"), get("ckpt/big.bin"), get("ckpt/big.bin"), get("ckpt/small.bin")]
    outcomes += [get("ckpt/big.bin"), get("ckpt/big.bin")]
    assert outcomes == ["ok", "ok", "SlowDown", "ok", "SlowDown", "ok"]
    with pytest.raises(client.exceptions.ClientError, match="InternalError"):
        client.put_object(Bucket=BUCKET, Key="scratch/p", Body=b"1")
    client.put_object(Bucket=BUCKET, Key="scratch/p", Body=b"1")
    proxy.fail("503", times=5)
    proxy.clear()
    assert get("ckpt/big.bin") == "ok"
    assert proxy.requests == 9 and proxy.faults == 3
    with pytest.raises(ValueError, match="unknown fault kind"):
        proxy.fail("explode")


def test_obstore_retries_through_a_503(s3: LocalS3, proxy: FaultProxy) -> None:
    retry = {"max_retries": 3, "backoff": {"init_backoff": timedelta(milliseconds=10)}}
    store = S3Store(BUCKET, **{**s3.storage_options, "endpoint": proxy.url}, retry_config=retry)
    proxy.fail("503", times=2)
    assert bytes(obstore.get_range(store, "ckpt/small.bin", start=0, end=8)) == _blob(SMALL, 1)[:8]
    assert [k for _, _, k in proxy.log] == ["503", "503", 206]


def test_counters_are_thread_safe(proxy: FaultProxy) -> None:
    proxy.fail("503", times=10, match="small.bin")
    errors: list[str] = []

    def worker() -> None:
        client = _boto(proxy.url)
        for _ in range(6):
            try:
                client.get_object(Bucket=BUCKET, Key="ckpt/small.bin", Range="bytes=0-0")
            except client.exceptions.ClientError as err:
                errors.append(err.response["Error"]["Code"])

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert proxy.requests == 36 and len(proxy.log) == 36
    assert proxy.faults == 10 and errors == ["SlowDown"] * 10
