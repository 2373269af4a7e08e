"""Checkpoints in object storage: a loopback S3 endpoint (moto's server, started here) holds
small checkpoints; 2 and 3 gloo ranks load them by ranged GETs in every reader mode, bit-exact
against transformers' load of the same files from disk. Faults come from a proxy in front of
the endpoint (tests/s3_proxy.py): throttling and 5xx answers, resets and slow answers are
retried and counted; persistent failures, missing or refused objects and an object replaced
mid-load are a named error on every rank, never a hang."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import cases_remote as cases
import pytest
import torch
from rank_group import RankGroup

from streamload.tools.quantized import make_fp8_checkpoint, make_mxfp4_checkpoint
from streamload.tools.synthetic import make_checkpoint

pytest.importorskip("obstore")
pytest.importorskip("moto")

from s3_proxy import FaultProxy  # noqa: E402

from streamload.tools.bench.s3 import LocalS3  # noqa: E402

WORLD = 3
BUCKET = "ckpts"
ATTN = dict(num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def s3():
    with LocalS3() as server:
        yield server


@pytest.fixture(scope="module")
def ckpts(s3: LocalS3, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """name -> (local directory, s3 URL of its copy)."""
    root = tmp_path_factory.mktemp("remote")
    made = {
        # Tensors of 64-512 KiB: a rank's slice of each is wider than the gap requests coalesce.
        "dense_tied": make_checkpoint(
            root / "dense_tied", "qwen2", hidden_size=256, intermediate_size=512, vocab=1000,
            layers=2, tie=True, seed=21, max_shard_size="600KB", **ATTN,
        ),
        "moe": make_checkpoint(
            root / "moe", "qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=256,
            num_experts=5, num_experts_per_tok=2, layers=2, vocab=600, tie=False, seed=22,
            max_shard_size="800KB", **ATTN,
        ),
        "fp8": make_fp8_checkpoint(
            root / "fp8", "llama", hidden_size=256, intermediate_size=384, seed=23, max_shard_size="400KB", **ATTN
        ),
        "mxfp4": make_mxfp4_checkpoint(
            root / "mxfp4", "gpt_oss", hidden_size=64, intermediate_size=96, num_local_experts=3,
            num_experts_per_tok=2, head_dim=16, layer_types=["sliding_attention", "full_attention"], seed=25,
            max_shard_size="100KB", **ATTN,
        ),
        # One file, no index.
        "single": make_checkpoint(root / "single", "llama", hidden_size=64, intermediate_size=96, seed=24, **ATTN),
    }  # fmt: skip
    return {k: (str(v), s3.upload_dir(v, BUCKET, k)) for k, v in made.items()}


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


def _fetched(res: list) -> int:
    return sum(r["report"]["remote_bytes"] for r in res if r)


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("readers", ["src", "owners", "auto", "node"])
def test_dense_and_moe_bit_exact(group: RankGroup, s3: LocalS3, ckpts, ws: int, readers: str) -> None:
    for name in ("dense_tied", "moe"):
        local, url = ckpts[name]
        res = group.run(
            cases.case_remote_load,
            url=url,
            local=local,
            ws=ws,
            readers=readers,
            storage_options=s3.storage_options,
        )
        reports = [r["report"] for r in res if r]
        headers = res[0]["headers"]
        payload = reports[0]["payload_bytes"]
        assert all(r["read_mode"] in ("remote", "") for r in reports), [r["read_mode"] for r in reports]
        if readers in ("src",):
            assert reports[0]["reader"].startswith("src")
            assert all(r["remote_bytes"] == 0 for r in reports[1:])
        if readers in ("owners", "auto"):
            # auto: every rank sees the same objects (bucket, key, size, ETag), so each reads its own.
            assert reports[0]["reader"].startswith("owners"), reports[0]["reader"]
            readers_n = ws
        else:
            readers_n = 1
        # No byte fetched twice per reader group: every reader's data bytes add up to the
        # payload (each opened the headers once; 1.05x leaves room for coalesced small gaps).
        data = _fetched(res) - readers_n * headers
        assert payload <= data <= 1.05 * payload, (name, readers, data, payload, headers)
        assert all(r["remote_retries"] == 0 for r in reports)
        if name == "moe" and readers == "src" and ws == WORLD:
            # Per-expert tensors in key order: a gate_up bucket's spans are split by the downs a
            # later bucket reads. Held between the reads (GapCache), they ride along: fewer
            # requests for the same bytes than with the cache off.
            off = group.run(
                cases.case_remote_load, url=url, local=local, ws=ws, readers=readers,
                storage_options={**s3.storage_options, "gap_cache_bytes": 0},
            )  # fmt: skip
            requests = [sum(r["report"]["remote_requests"] for r in run if r) for run in (res, off)]
            assert _fetched(res) == _fetched(off) and requests[0] < requests[1], requests


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_quantized_and_single_file(group: RankGroup, s3: LocalS3, ckpts, readers: str) -> None:
    for name, dtype in (("fp8", torch.bfloat16), ("mxfp4", torch.bfloat16), ("single", None)):
        local, url = ckpts[name]
        group.run(
            cases.case_remote_load, url=url, local=local, ws=WORLD, readers=readers,
            storage_options=s3.storage_options, dtype=dtype,
        )  # fmt: skip
    # A single file named by its own key, into a model built beside the load.
    local, url = ckpts["single"]
    res = group.run(
        cases.case_remote_load_checkpoint, url=url + "model.safetensors", local=local, ws=2, readers=readers,
        storage_options=s3.storage_options,
    )  # fmt: skip
    assert res[0]["remote_bytes"] > 0


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_column_shards(group: RankGroup, s3: LocalS3, ckpts, readers: str) -> None:
    """Shards on dim 1: each rank's bytes are a strided part of every row range."""
    local, url = ckpts["dense_tied"]
    group.run(
        cases.case_remote_load_checkpoint, url=url, local=local, ws=WORLD, readers=readers,
        storage_options=s3.storage_options, shard_dim=1,
    )  # fmt: skip


def test_configs_read_as_transformers(s3: LocalS3, ckpts) -> None:
    """config.json and generation_config.json fetched whole and parsed as AutoConfig reads them."""
    from transformers import AutoConfig, GenerationConfig

    from streamload.integrations.pretrained import _read_configs
    from streamload.io.remote import as_remote

    for local, url in ckpts.values():
        got = _read_configs(as_remote(url, s3.storage_options))
        want = AutoConfig.from_pretrained(local).to_dict()
        assert got["config"].to_dict() == {**want, "_name_or_path": url}
        assert got["generation_config"].to_dict() == GenerationConfig.from_pretrained(local).to_dict()


def test_standard_environment(group: RankGroup, s3: LocalS3, ckpts) -> None:
    """No storage_options: endpoint and credentials from AWS_ENDPOINT_URL and AWS_* variables."""
    local, url = ckpts["dense_tied"]
    group.run(
        cases.case_remote_load, url=url, local=local, ws=2, readers="auto", storage_options=None, env=s3.env
    )


def _through(proxy: FaultProxy, s3: LocalS3, **extra: str) -> dict[str, str]:
    return {**s3.storage_options, "endpoint": proxy.url, **extra}


def test_transient_faults_are_retried(group: RankGroup, s3: LocalS3, ckpts) -> None:
    local, url = ckpts["dense_tied"]
    with FaultProxy(s3.url) as proxy:
        for kind, extra in (
            ("503", {}),
            ("500", {}),
            ("reset", {}),
            ("truncate", {}),
            ("delay:3", {"timeout": "1s"}),
        ):
            proxy.clear()
            before = proxy.faults
            # Data requests of the first shard (its header GET passes).
            proxy.fail(kind, times=2, match="dense_tied/model-00001", after=1)  # after its header
            res = group.run(
                cases.case_remote_load, url=url, local=local, ws=WORLD, readers="src",
                storage_options=_through(proxy, s3, **extra),
            )  # fmt: skip
            assert proxy.faults - before == 2, (kind, proxy.faults - before)
            assert res[0]["report"]["remote_retries"] >= 2, (kind, res[0]["report"]["remote_retries"])


def _all_failed(res: list, ws: int, *words: str) -> list:
    errs = [r for r in res[:ws]]
    assert all(e is not None for e in errs), errs
    for e in errs:
        for w in words:
            assert w in e["message"], (w, e)
        assert e["seconds"] < 60, e
    return errs


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_persistent_failures_are_named_on_every_rank(
    group: RankGroup, s3: LocalS3, ckpts, readers: str
) -> None:
    local, url = ckpts["dense_tied"]
    with FaultProxy(s3.url) as proxy:
        proxy.fail("503", times=10_000, match="dense_tied/model-00002", after=2)
        res = group.run(
            cases.case_remote_fails, url=url, ws=WORLD, readers=readers,
            storage_options=_through(proxy, s3, retries="2"),
        )  # fmt: skip
        errs = _all_failed(res, WORLD, "model-00002")
        assert any("after 3 attempt" in e["message"] for e in errs), errs


def test_missing_object_and_bad_index(group: RankGroup, s3: LocalS3, ckpts, tmp_path: Path) -> None:
    local, _ = ckpts["dense_tied"]
    # The index names a shard that is not there.
    url = s3.upload_dir(local, BUCKET, "missing_shard")
    index = json.loads((Path(local) / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    s3.delete(BUCKET, f"missing_shard/{shard}")
    res = group.run(
        cases.case_remote_fails, url=url, ws=WORLD, readers="src", storage_options=s3.storage_options
    )
    _all_failed(res, WORLD, "no such object", shard)
    # An index entry that leaves the prefix.
    index["weight_map"][next(iter(index["weight_map"]))] = "../other/model.safetensors"
    url = s3.upload_dir(local, BUCKET, "escaping")
    s3.put(BUCKET, "escaping/model.safetensors.index.json", json.dumps(index).encode())
    res = group.run(
        cases.case_remote_fails, url=url, ws=WORLD, readers="src", storage_options=s3.storage_options
    )
    _all_failed(res, WORLD, "leaves the checkpoint's prefix")
    # Nothing under the prefix at all.
    res = group.run(
        cases.case_remote_fails, url=f"s3://{BUCKET}/nothing_here/", ws=WORLD, readers="auto",
        storage_options=s3.storage_options,
    )  # fmt: skip
    _all_failed(res, WORLD)


def test_access_denied(group: RankGroup, s3: LocalS3, ckpts) -> None:
    local, url = ckpts["dense_tied"]
    with FaultProxy(s3.url) as proxy:
        proxy.fail("403", times=10_000, match="dense_tied/")
        res = group.run(
            cases.case_remote_fails, url=url, ws=WORLD, readers="src", storage_options=_through(proxy, s3)
        )
        _all_failed(res, WORLD, "access denied")


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_object_replaced_mid_load(group: RankGroup, s3: LocalS3, ckpts, readers: str) -> None:
    """The shard's data requests are held back 2 s at the proxy; as soon as the first one is
    held, the shard is overwritten at the endpoint. Every request names the ETag the table was
    read from, so the load fails on every rank instead of mixing two versions."""
    local, _ = ckpts["dense_tied"]
    prefix = f"replaced_{readers}"
    url = s3.upload_dir(local, BUCKET, prefix)
    shard = sorted(p.name for p in Path(local).glob("*.safetensors"))[0]
    key = f"{prefix}/{shard}"
    new_version = (Path(local) / shard).read_bytes()[:-1] + b"\x00"
    with FaultProxy(s3.url) as proxy:
        # After each opening rank's header request (the reader's alone in src mode).
        proxy.fail("delay:2", times=10_000, match=key, after=WORLD if readers == "owners" else 1)

        def overwrite_when_held() -> None:
            deadline = time.monotonic() + 60
            while proxy.faults == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            s3.put(BUCKET, key, new_version)

        writer = threading.Thread(target=overwrite_when_held, daemon=True)
        writer.start()
        res = group.run(
            cases.case_remote_fails, url=url, ws=WORLD, readers=readers, storage_options=_through(proxy, s3)
        )
        writer.join()
    _all_failed(res, WORLD, "changed during the load")


@pytest.mark.parametrize("readers", ["owners", "node", "auto"])
def test_other_versions_at_open_fall_back_to_the_reader(
    group: RankGroup, s3: LocalS3, ckpts, readers: str
) -> None:
    local, url = ckpts["dense_tied"]
    res = group.run(
        cases.case_other_version_on_open,
        url=url,
        local=local,
        readers=readers,
        storage_options=s3.storage_options,
    )
    assert all(r["reader"].startswith("src") for r in res), [r["reader"] for r in res]
    assert all(r["remote_bytes"] > 0 for r in res[:1])


def test_other_ranks_ask_for_their_view_while_the_reader_opens(group: RankGroup, s3: LocalS3, ckpts) -> None:
    """readers="auto" compares every rank's view of the objects (key, size, ETag): the reader's is
    the objects it opened (no second listing), the others ask on a helper thread started before
    they wait for the reader's table, so their round trips overlap its own; src asks nothing."""
    _, url = ckpts["dense_tied"]
    got = group.run(cases.case_identity_asks, url=url, readers="auto", storage_options=s3.storage_options)
    assert got == [[]] + [["streamload-identity"]] * (WORLD - 1), got
    got = group.run(cases.case_identity_asks, url=url, readers="src", storage_options=s3.storage_options)
    assert got == [[]] * WORLD, got
    # No helper thread to be had: each other rank asks on its own, in the reader choice (no hang).
    got = group.run(
        cases.case_identity_asks, url=url, readers="auto", storage_options=s3.storage_options, no_thread=True
    )
    assert got == [[]] + [["MainThread"]] * (WORLD - 1), got


def test_unreachable_endpoint_fails_fast(group: RankGroup, s3: LocalS3, ckpts) -> None:
    _, url = ckpts["dense_tied"]
    opts = {**s3.storage_options, "endpoint": "http://127.0.0.1:9", "retries": "1", "connect_timeout": "1s"}
    res = group.run(cases.case_remote_fails, url=url, ws=2, readers="auto", storage_options=opts)
    _all_failed(res, 2)
