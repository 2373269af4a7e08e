"""Layout cases run inside the rank group (see rank_group.py): every 2-D
combination of Shard/Replicate/_StridedShard on a 2x2 mesh, against torch's
own distribute_tensor, and loaded through streamload bit-exact; Partial and
unknown placements refused by name on every rank."""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
from torch import nn

import streamload
from streamload.io.copy_ops import bit_view as bits
from streamload.model.layouts import local_layout

SHAPES = [(8, 6), (7, 5), (3, 2), (1, 3), (0, 4)]  # even, uneven, fewer rows than chunks, empty


def placement_choices() -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [
        Shard(0),
        Shard(1),
        Replicate(),
        _StridedShard(0, split_factor=2),
        _StridedShard(1, split_factor=2),
        _StridedShard(0, split_factor=3),
    ]


def combos() -> list[tuple[Any, Any]]:
    return list(itertools.product(placement_choices(), repeat=2))


def mesh_2x2():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def expected_local(full: torch.Tensor, parts, extent) -> torch.Tensor:
    out = torch.full(extent, -1.0, dtype=full.dtype)
    for box, start in parts:
        src = full[tuple(slice(lo, hi) for lo, hi in box)]
        out[tuple(slice(s, s + n) for s, n in zip(start, src.shape, strict=True))] = src
    return out


def case_boxes_match_torch(rank: int, world: int) -> dict[str, int]:
    """local_parts (pure) reproduces distribute_tensor's local shard for every combination."""
    from torch.distributed.tensor import distribute_tensor

    mesh = mesh_2x2()
    coord = mesh.get_coordinate()
    checked = multi = 0
    for placements in combos():
        for shape in SHAPES:
            full = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float64)[
                : torch.Size(shape).numel()
            ]
            full = full.reshape(shape)
            # src_data_rank=None: every rank splits its own copy, so no collective can hang on a failure.
            local = distribute_tensor(full, mesh, list(placements), src_data_rank=None).to_local()
            parts, extent = local_layout(shape, (2, 2), placements, coord)
            want = expected_local(full, parts, extent)
            assert tuple(local.shape) == tuple(want.shape), (placements, shape, local.shape, want.shape)
            assert torch.equal(local, want), (placements, shape, local, want)
            # The boxes are disjoint and cover exactly the local shard.
            assert sum(torch.Size([hi - lo for lo, hi in b]).numel() for b, _ in parts) == local.numel()
            checked += 1
            multi += len(parts) > 1
    return {"checked": checked, "multi_box": multi}


class Grid(nn.Module):
    """One 2-D parameter per (combination, shape): each gets its own layout."""

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])


def grid_state(shapes: list[tuple[int, int]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"params.{i}": torch.randn(s, generator=gen).to(torch.bfloat16) for i, s in enumerate(shapes)}


def grid_model(
    shapes: list[tuple[int, int]], placements: list[tuple[Any, Any]], mesh, dtype: torch.dtype
) -> Grid:
    from torch.distributed.tensor import distribute_tensor

    net = Grid(shapes)
    for i, pl in enumerate(placements):
        empty = torch.full(shapes[i], float("nan"), dtype=dtype)
        # src_data_rank=None: torch cannot scatter uneven _StridedShard from a source rank.
        net.params[i] = nn.Parameter(distribute_tensor(empty, mesh, list(pl), src_data_rank=None))
    return net


def grid_shapes() -> list[tuple[int, int]]:
    return [s for _ in combos() for s in SHAPES]


def case_load_grid(rank: int, world: int, *, ckpt: str, readers: str, dtype: torch.dtype) -> dict[str, Any]:
    """Every combination loaded through load_checkpoint: full_tensor() equals the file, as bytes."""
    from safetensors.torch import load_file

    mesh = mesh_2x2()
    shapes = grid_shapes()
    layouts = [pl for pl in combos() for _ in SHAPES]
    net = grid_model(shapes, layouts, mesh, dtype)
    nodes = readers == "node"
    if nodes:  # two simulated nodes of two ranks; the first rank of each reads
        os.environ["STREAMLOAD_NODE"] = str(rank // 2)
    sees = readers != "src" or rank == 0 or (nodes and rank % 2 == 0)
    try:
        report = streamload.load_checkpoint(
            net,
            ckpt if sees else "/nonexistent/streamload/ckpt",
            device_mesh=mesh,
            bucket_bytes=512,
            progress=False,
            readers=readers,
        )
    finally:
        os.environ.pop("STREAMLOAD_NODE", None)
    from torch.distributed.tensor import distribute_tensor

    want = load_file(os.path.join(ckpt, "model.safetensors"))
    bad = []
    for i in range(len(shapes)):
        # torch's own local shard of the file's tensor is the reference: torch
        # 2.13's full_tensor() itself fails on some uneven _StridedShard layouts
        # (an unpad check in Shard._to_replicate_tensor), so it cannot be the judge.
        got = net.params[i].to_local()
        ref = distribute_tensor(want[f"params.{i}"].to(dtype), mesh, list(layouts[i]), src_data_rank=None)
        ref = ref.to_local()
        if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(bits(got), bits(ref)):
            bad.append((i, layouts[i], shapes[i]))
    assert not bad, bad
    return {
        "mode": report.reader.split()[0].split(":")[0],
        "reader": report.reader,
        "buckets": report.buckets,
    }


def case_refused(rank: int, world: int, *, ckpt: str, kind: str) -> str:
    """A Partial (or unknown) placement raises PlacementError on every rank, before any byte."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import Placement

    class Custom(Placement):  # a placement type streamload has never heard of
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Custom)

        def __hash__(self) -> int:
            return 7

    mesh = mesh_2x2()
    shapes = [(8, 6), (7, 5)]
    net = grid_model(shapes, [(Shard(0), Shard(1))] * 2, mesh, torch.float32)
    bad = Partial() if kind == "partial" else Custom()
    local = torch.full((7, 5), float("nan"))
    dt = DTensor.from_local(local, mesh, [Replicate(), bad], run_check=False, shape=(7, 5), stride=(5, 1))
    net.params[1] = nn.Parameter(dt)
    before = net.params[0].to_local().clone()
    exc = placement_error(net, ckpt, rank, mesh)
    assert exc is not None, "a Partial/unknown placement loaded without error"
    # Nothing was written: the other parameter still holds its NaNs.
    assert torch.equal(bits(net.params[0].to_local()), bits(before))
    assert exc.tensor == "params.1", exc.tensor
    return str(exc)


def placement_error(net: nn.Module, ckpt: str, rank: int, mesh: Any) -> streamload.PlacementError | None:
    """The PlacementError a src-mode load of ``net`` raises on this rank, or None when it loads."""
    try:
        streamload.load_checkpoint(
            net,
            ckpt if rank == 0 else "/nonexistent/streamload/ckpt",
            device_mesh=mesh,
            progress=False,
            strict=False,
        )
    except streamload.PlacementError as exc:
        return exc
    return None


def case_specs_differ(rank: int, world: int, *, ckpt: str) -> str:
    """Ranks whose layouts disagree (one rank shards a parameter differently) all raise PlacementError."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = mesh_2x2()
    odd = (Shard(1), Replicate()) if rank == 3 else (Shard(0), Replicate())
    net = grid_model([(8, 6), (7, 5)], [odd, (Shard(0), Shard(1))], mesh, torch.float32)
    exc = placement_error(net, ckpt, rank, mesh)
    assert exc is not None, "ranks with different layouts loaded without error"
    return str(exc)
