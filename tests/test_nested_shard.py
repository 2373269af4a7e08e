"""FSDP2 over tensor parallelism shards each TP chunk again (nested torch.chunk) and describes it
as _StridedShard + Shard. Where the two layouts differ (a dim not divisible by the TP degree,
e.g. GPT-2's vocabulary of 50257 over tp=2, dp=4) the load is refused with a message that says
which parameter, which dim, the degrees, the rows held and the fix; where the dim divides, the
layouts are the same and nothing is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from streamload.errors import PlacementError
from streamload.model.layouts import local_layout, nested_shard_mismatch
from streamload.model.state import local_placement


def _chunk(rows: list[int], n: int, i: int) -> list[int]:
    """Chunk ``i`` of ``n`` as torch.chunk cuts them, empty where torch.chunk returns fewer
    (FSDP2's ``_chunk_with_empty``)."""
    step = -(-len(rows) // n)
    return rows[i * step : (i + 1) * step]


def _fsdp_rows(size: int, dp: int, tp: int, coord: tuple[int, int]) -> list[int]:
    """The global rows FSDP2 keeps at (dp, tp): its dp chunk of the TP rank's chunk."""
    return _chunk(_chunk(list(range(size)), tp, coord[1]), dp, coord[0])


def _layout_rows(size: int, dp: int, tp: int, coord: tuple[int, int]) -> list[int]:
    parts, _ = local_layout((size, 3), (dp, tp), (_StridedShard(0, split_factor=tp), Shard(0)), coord)
    return [r for box, _ in parts for r in range(*box[0])]


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2), (3, 2), (4, 2), (2, 3), (4, 3), (5, 4)])
def test_nested_fsdp_layout_is_the_placements_whenever_the_dim_divides(dp: int, tp: int) -> None:
    for size in range(tp, 12 * tp * dp + 1, tp):
        for coord in [(i, j) for i in range(dp) for j in range(tp)]:
            assert _layout_rows(size, dp, tp, coord) == _fsdp_rows(size, dp, tp, coord), (size, coord)


def test_gpt2_vocabulary_over_tp2_dp4_is_refused_precisely() -> None:
    size, mesh, placements = 50257, (4, 2), (_StridedShard(0, split_factor=2), Shard(0))
    differ = [
        c
        for c in [(i, j) for i in range(4) for j in range(2)]
        if _layout_rows(size, 4, 2, c) != _fsdp_rows(size, 4, 2, c)
    ]
    assert differ == [(3, 0), (3, 1)]
    why = nested_shard_mismatch((size, 768), mesh, placements, (3, 0), (6280, 768))
    assert why is not None
    assert "dim 0 (50257) is split over 2 TP ranks (mesh dim 1), then each TP chunk over 4 FSDP ranks" in why
    assert "the local shard is [6280, 768] where the placements give [6281, 768]" in why
    assert "pad_to_multiple_of=2" in why
    assert nested_shard_mismatch((50256, 768), mesh, placements, (3, 0), (6282, 768)) is None
    assert nested_shard_mismatch((size, 768), mesh, (Shard(0), Shard(1)), (3, 0), (6280, 768)) is None
    other = (_StridedShard(0, split_factor=3), Shard(0))  # not FSDP2's nesting (3 != tp)
    assert nested_shard_mismatch((size, 768), mesh, other, (3, 0), (6280, 768)) is None

    # As a load sees it: the parameter FSDP2 left at (3, 0) holds 6280 rows.
    mesh_ = SimpleNamespace(shape=mesh, get_coordinate=lambda: [3, 0])
    param = SimpleNamespace(
        shape=torch.Size((size, 768)),
        dtype=torch.bfloat16,
        device_mesh=mesh_,
        placements=placements,
        dim=lambda: 2,
        to_local=lambda: torch.empty(6280, 768, dtype=torch.bfloat16, device="meta"),
    )
    with pytest.raises(PlacementError) as err:
        local_placement(param, "lm_head.weight")  # type: ignore[arg-type]
    assert err.value.tensor == "lm_head.weight"
    assert "[50257, 768]: FSDP2 shards the tensor-parallel shard again" in str(err.value)
