"""src mode with real gloo ranks: receivers place no other rank, and the load stays bit-exact
(odd world sizes, small buckets so receivers skip buckets they have no bytes in)."""

from __future__ import annotations

import cases_src_plan as cases
import pytest
from rank_group import RankGroup

from streamload.tools.synthetic import make_checkpoint

WORLD = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("ckpts")
    return str(
        make_checkpoint(
            root / "tied", "qwen2", tie=True, seed=7, layers=2, vocab=61, hidden_size=24,
            intermediate_size=38, num_attention_heads=4, num_key_value_heads=2, max_shard_size="8KB",
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("bucket_bytes", [256, 4096])
def test_receivers_place_themselves_only(group: RankGroup, ckpt: str, ws: int, bucket_bytes: int) -> None:
    res = group.run(cases.case_src_places, ckpt=ckpt, ws=ws, bucket_bytes=bucket_bytes)
    assert res[0]["asked"] == list(range(ws))  # the reader serves every rank
    for r in range(1, ws):
        assert res[r]["asked"] == [r], res[r]["asked"]
    rep = res[0]["report"]
    assert rep["buckets"] > 1
    assert sum(rep["bytes_received"]) == rep["payload_bytes"]
    assert all(res[r]["report"]["bytes_received"] == rep["bytes_received"] for r in range(ws))
    assert rep["peak_staging_bytes"] <= rep["slots"] * bucket_bytes
