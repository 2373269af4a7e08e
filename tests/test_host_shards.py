"""Shards that live on the host in a device load (issue #43 item 8): FSDP2 CPU offload with a
persistent buffer from the checkpoint. The offloaded shards are filled in place from the
files; only the buffer is staged to the (fake) device. Real gloo ranks, uneven shards."""

from __future__ import annotations

import cases_host_shards as cases
import pytest
from rank_group import RankGroup
from safetensors.torch import save_file

from streamload.plan.buckets import Bucket, Segment, split_direct

WORLD = 3


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("host_shards")
    save_file(cases.net_state(), str(root / "model.safetensors"))
    return str(root)


@pytest.mark.parametrize("ws", [2, 3])
def test_offloaded_shards_are_never_staged_through_the_device(group: RankGroup, ckpt: str, ws: int) -> None:
    res = group.run(cases.case_offloaded_buffer_load, ckpt=ckpt, ws=ws)
    for r in res[:ws]:
        assert r["bad"] == [], r
        # Host -> device: the buffer's 20 bytes alone (padded to 8), none of the offloaded
        # shards' (which would come back device -> host one segment at a time).
        assert r["buffer_bytes"] == 20 and r["copied"] == 24, r
        assert r["stagers"] == 1 and r["shard_bytes"] > 0, r


def test_split_direct_lays_the_staged_part_out_afresh() -> None:
    seg = [
        Segment(t, 1, ((0, n),), (0,), "F32", off, 4 * n) for t, n, off in [(0, 3, 0), (1, 2, 16), (2, 5, 24)]
    ]
    bucket = Bucket([[], seg], [0, 48])
    in_place, staged = split_direct(bucket, 1, frozenset({1}))
    assert in_place is not None and in_place.direct_rank == 1
    assert [s.target for s in in_place.segments[1]] == [1] and in_place.segments[0] == []
    assert [(s.target, s.offset) for s in staged.segments[1]] == [(0, 0), (2, 16)]
    assert staged.rank_bytes == [0, 16 + 24] and staged.direct_rank is None
    none, everything = split_direct(bucket, 1, frozenset())
    assert none is None and [s.offset for s in everything.segments[1]] == [0, 16, 24]
