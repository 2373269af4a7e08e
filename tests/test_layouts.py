"""Layouts and specs as pure functions (no process group): boxes of strided
layouts, sibling submesh coordinates, spec digests, served-rank plans."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from streamload.errors import PlacementError
from streamload.model.layouts import check_placements, dim_runs, local_layout, local_parts
from streamload.model.specs import LayoutSpec, MeshInfo, placement_for, placements_for, spec_digest
from streamload.plan.buckets import Target, build_plan
from streamload.plan.regions import identity_piece


def test_strided_runs_by_hand() -> None:
    # 8 rows, FSDP (2) over TP (2): tp rank t holds rows [4t, 4t+4), dp rank d the half d of that.
    tp_fsdp = (_StridedShard(0, split_factor=2), Shard(0))
    got = {(d, t): local_parts((8, 3), (2, 2), tp_fsdp, (d, t)) for d in range(2) for t in range(2)}
    assert got[(0, 1)] == ((((4, 6), (0, 3)), (0, 0)),)
    assert got[(1, 0)] == ((((2, 4), (0, 3)), (0, 0)),)
    # The other order interleaves: two disjoint boxes, stacked in the local shard.
    assert local_parts((8, 3), (2, 2), (Shard(0), _StridedShard(0, split_factor=2)), (0, 1)) == (
        (((1, 2), (0, 3)), (0, 0)),
        (((3, 4), (0, 3)), (1, 0)),
    )
    # torch.chunk: 7 rows in 3 -> [0-2], [3-5], [6]; chunk 1 of 2 of each -> row 2, row 5, nothing.
    assert dim_runs(7, ((_StridedShard(0, split_factor=3), 2, 1),)) == ((2, 1), (5, 1))


def test_empty_shards_keep_their_other_dims() -> None:
    assert local_layout((1, 3), (2, 2), (Shard(0), Shard(0)), (1, 0)) == ((), (0, 3))
    assert local_layout((0, 4), (2, 2), (Replicate(), Shard(1)), (0, 1)) == ((), (0, 2))
    assert local_layout((5, 4), (2, 2), (Shard(0), Replicate()), None) == ((), (0, 0))


def test_refused_placements_name_the_parameter() -> None:
    with pytest.raises(PlacementError, match="Partial") as exc:
        check_placements("lm_head.weight", (Replicate(), Partial()), 2)
    assert exc.value.tensor == "lm_head.weight"
    with pytest.raises(PlacementError, match="shard dim 2"):
        check_placements("w", (Shard(2),), 2)
    check_placements("w", (Shard(-1), _StridedShard(0, split_factor=2), Replicate()), 2)


def test_sibling_submesh_coordinates() -> None:
    # mesh["dp"] of a (dp, tp) 2x2 mesh: instances [0, 2] (tp 0) and [1, 3] (tp 1).
    dp = MeshInfo((2,), (0, 2, 1, 3))
    assert [dp.coordinate(r) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert dp.coordinate(9) is None
    root = MeshInfo((2, 2), (0, 1, 2, 3))
    assert root.coordinate(2) == (1, 0)


def test_placement_for_and_digest() -> None:
    mesh = MeshInfo((2, 2), (0, 1, 2, 3))
    spec = LayoutSpec((8, 3), "BF16", mesh, (Shard(0), _StridedShard(0, split_factor=2)))
    p = placement_for(spec, 1)  # coordinate (0, 1): two boxes
    assert p.box == ((0, 0), (0, 0)) and len(p.boxes) == 2
    assert placement_for(LayoutSpec((5,), "F32"), 3).boxes == ((((0, 5),), (0,)),)
    names = ["a"]
    other = LayoutSpec((8, 3), "BF16", mesh, (Shard(0), Shard(0)))
    assert spec_digest(names, [spec]) == spec_digest(names, [spec])
    assert spec_digest(names, [spec]) != spec_digest(names, [other])
    assert len(spec_digest(names, [spec])) == 32


def test_plan_over_served_ranks_only() -> None:
    # A node's plan at 4,096 ranks has 8 rows, and a multi-box shard lands at its local starts.
    world = 4096
    mesh = MeshInfo((world // 4, 2, 2), tuple(range(world)))
    targets = [Target("w", (8, 4), (identity_piece("w", (8, 4)),))]
    specs = [LayoutSpec((8, 4), "F32", mesh, (Replicate(), Shard(0), _StridedShard(0, split_factor=2)))]
    plan = build_plan(targets, {"w": "F32"}, placements_for(specs, list(range(8))), 1 << 20)
    assert plan.world_size == 8
    segs = [(s.box, s.local_start) for b in plan.buckets for s in b.segments[1]]  # coordinate (0, 0, 1)
    assert segs == [(((1, 2), (0, 4)), (0, 0)), (((3, 4), (0, 4)), (1, 0))]
    # Ranks 0-3 tile the tensor once, ranks 4-7 (the next replica) once more.
    rows = sorted(r for b in plan.buckets for k in range(8) for s in b.segments[k] for r in range(*s.box[0]))
    assert rows == sorted(list(range(8)) * 2)


def test_cached_layouts_keep_strided_and_plain_shards_apart() -> None:
    """local_layout is cached per (shape, mesh, placements, coordinate): a _StridedShard and a
    Shard on the same dim, asked in either order, keep their own layouts (torch compares them
    unequal today; the key holds each placement's type too, so that it stays so); lists and
    tuples for the same arguments give the same answer."""
    shape, mesh = (8, 4), (2, 2)
    plain = (Shard(0), Shard(0))
    strided = (Shard(0), _StridedShard(0, split_factor=2))
    want_strided = ((((1, 2), (0, 4)), (0, 0)), (((3, 4), (0, 4)), (1, 0)))
    for _ in range(2):
        assert local_parts(shape, mesh, plain, (0, 1)) == ((((2, 4), (0, 4)), (0, 0)),)
        assert local_parts(shape, mesh, strided, (0, 1)) == want_strided
    assert local_layout([8, 4], [2, 2], list(strided), [0, 1]) == local_layout(shape, mesh, strided, (0, 1))
    assert local_layout(shape, mesh, plain, None) == ((), (0, 0))
