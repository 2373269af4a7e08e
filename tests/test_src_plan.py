"""The src plan as pure functions (no process group): bucket boundaries from the specs alone, a
receiver's plan placing no other rank and equal to its row of the reader's plan, exact tiling."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from streamload.model.specs import LayoutSpec, MeshInfo, global_layout, placement_for
from streamload.plan.buckets import ALIGN, Placement, Target
from streamload.plan.global_buckets import GlobalLayout, _Filler, build_served_plan
from streamload.plan.regions import box_numel, identity_piece

PLACEMENTS = [
    Shard(0),
    Shard(1),
    Replicate(),
    _StridedShard(0, split_factor=2),
    _StridedShard(1, split_factor=3),
]


def _case(seed: int) -> tuple[list[Target], list[LayoutSpec], int]:
    """Random 2-D/1-D/0-d targets on a random 1-D or 2-D mesh (odd sizes, uneven and empty shards)."""
    rng = random.Random(seed)
    mesh_shape = rng.choice([(3,), (5,), (2, 3), (3, 2), (1, 4)])
    world = 1
    for n in mesh_shape:
        world *= n
    mesh = MeshInfo(mesh_shape, tuple(range(world)))
    targets: list[Target] = []
    specs: list[LayoutSpec] = []
    for i in range(rng.randint(3, 8)):
        ndim = rng.choice([0, 1, 2, 2])
        shape = tuple(
            rng.choice([0, 1, 2, 5, 7, 13]) if rng.random() < 0.2 else rng.randint(1, 40) for _ in range(ndim)
        )
        name = f"t{i}"
        targets.append(Target(name, shape, (identity_piece(name, shape),)))
        dtype = rng.choice(["F32", "BF16"])
        if ndim == 0 or rng.random() < 0.15:
            specs.append(LayoutSpec(shape, dtype))  # a plain tensor: every rank holds it
            continue
        pl = tuple(
            p if not hasattr(p, "dim") or p.dim < ndim else Replicate()
            for p in (rng.choice(PLACEMENTS) for _ in mesh_shape)
        )
        specs.append(LayoutSpec(shape, dtype, mesh, pl))
    return targets, specs, world


def _cells(box) -> set[tuple[int, ...]]:
    return set(itertools.product(*[range(lo, hi) for lo, hi in box]))


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("bucket", [64, 200, 4096])
def test_receiver_plan_is_its_row_of_the_readers(seed: int, bucket: int) -> None:
    targets, specs, world = _case(seed)
    dtypes = {t.name: "BF16" for t in targets}
    layouts = [global_layout(s, world) for s in specs]
    reader = build_served_plan(
        targets, dtypes, layouts, world, lambda r, t: placement_for(specs[t], r), bucket
    )
    for me in range(world):
        calls: list[int] = []

        def mine(row: int, t: int, me: int = me, calls: list[int] = calls) -> Placement:
            assert row == 0, "a receiver's plan has one row"
            calls.append(t)
            return placement_for(specs[t], me)

        own = build_served_plan(targets, dtypes, layouts, 1, mine, bucket)
        assert len(own.buckets) == len(reader.buckets)
        for b_own, b_all in zip(own.buckets, reader.buckets, strict=True):
            assert b_own.segments[0] == [s.__class__(**{**s.__dict__, "rank": 0}) for s in b_all.segments[me]]
            assert b_own.rank_bytes[0] == b_all.rank_bytes[me]
        assert len(calls) == len(set(calls))  # one call per target, for this rank only
    # Every rank's segments tile exactly its placements, once.
    for r in range(world):
        for t_idx, spec in enumerate(specs):
            got = [
                c for b in reader.buckets for s in b.segments[r] if s.target == t_idx for c in _cells(s.box)
            ]
            want = [c for box, _ in placement_for(spec, r).boxes for c in _cells(box)]
            assert sorted(got) == sorted(want), (seed, r, t_idx)
    # Every bucket's wire total stays within the bucket unless one element over every copy exceeds it.
    for b in reader.buckets:
        worst = (
            max(
                (ITEM[layouts[s.target].dtype] + ALIGN) * layouts[s.target].copies
                for segs in b.segments
                for s in segs
            )
            if any(b.segments)
            else 0
        )
        assert b.total_bytes <= max(bucket, worst)


ITEM = {"F32": 4, "BF16": 2}


@pytest.mark.parametrize("seed", range(40))
def test_copies_count_every_holder(seed: int) -> None:
    # The boundaries' only global input: the count of ranks holding each element.
    _, specs, world = _case(seed)
    for spec in specs:
        held = sum(box_numel(box) for r in range(world) for box, _ in placement_for(spec, r).boxes)
        n = box_numel(tuple((0, s) for s in spec.shape))
        lay = global_layout(spec, world)
        assert held == n * lay.copies
        assert sum(len(placement_for(spec, r).boxes) for r in range(world)) <= lay.max_segments


def test_sibling_instances_count_as_copies() -> None:
    # A submesh ("dp" of a (dp, tp) mesh) has one instance per tp coordinate: each holds the tensor once.
    sub = MeshInfo((2,), (0, 2, 1, 3))
    spec = LayoutSpec((6, 4), "F32", sub, (Shard(0),))
    assert global_layout(spec, 4) == GlobalLayout("F32", 2, 4)
    assert global_layout(LayoutSpec((3,), "BF16"), 7) == GlobalLayout("BF16", 7, 7)


def test_receiver_at_8192_ranks_places_itself_only() -> None:
    # Buckets from the specs alone: a receiver of 8,192 ranks calls the placement function once per
    # target, for its own row, and gets the same bucket count as any other rank.
    world = 8192
    mesh = MeshInfo((world,), tuple(range(world)))
    shapes = [(129280, 64), (64,), (256, 32, 16), (1024, 1024)]
    targets = [Target(f"w{i}", s, (identity_piece(f"w{i}", s),)) for i, s in enumerate(shapes)]
    specs = [LayoutSpec(s, "BF16", mesh, (Shard(0),)) for s in shapes]
    layouts = [global_layout(s, world) for s in specs]
    dtypes = {t.name: "BF16" for t in targets}
    counts = []
    for me in (0, 5, 8191):
        seen: list[tuple[int, int]] = []

        def place(row: int, t: int, me: int = me, seen: list[tuple[int, int]] = seen) -> Placement:
            seen.append((row, t))
            return placement_for(specs[t], me)

        plan = build_served_plan(targets, dtypes, layouts, 1, place, 1 << 20)
        assert sorted(seen) == [(0, t) for t in range(len(targets))]
        assert plan.world_size == 1
        counts.append(len(plan.buckets))
        got = sum(box_numel(s.box) for b in plan.buckets for s in b.segments[0])
        assert got == sum(box_numel(p.box) for p in (placement_for(s, me) for s in specs))
    assert len(set(counts)) == 1 and counts[0] > 1
    # The 8,192-row plan (the reader's) has the same buckets.
    reader = build_served_plan(
        targets, dtypes, layouts, world, lambda r, t: placement_for(specs[t], r), 1 << 20
    )
    assert len(reader.buckets) == counts[0]
    assert reader.max_bucket_bytes <= 1 << 20


@pytest.mark.parametrize("seed", range(200))
def test_arithmetic_runs_place_chunks_as_one_by_one(seed: int) -> None:
    # A receiver places a run of equal chunks by arithmetic; the result must be the sequential rule's.
    rng = random.Random(seed)
    capacity = rng.randint(32, 500)
    fast, slow = _Filler(capacity), _Filler(capacity)
    for _ in range(rng.randint(1, 6)):
        count, bound = rng.randint(0, 40), rng.choice([1, 7, 30, capacity // 3 + 1, capacity, capacity + 5])
        if rng.random() < 0.3:
            b = rng.randint(1, capacity)
            assert fast.add(b) == slow.add(b)
        bucket_of = fast.add_run(count, bound)
        assert [bucket_of(k) for k in range(count)] == [slow.add(bound) for _ in range(count)]
        assert (fast.index, fast.used, fast.count) == (slow.index, slow.used, slow.count)
