"""Exact-tiling cases run inside the rank group (tests/test_save_tiling.py): each rank shards
a small plain model over a mesh of its own choosing (one per rank, or meshes that overlap),
then saves it over the whole world."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import streamload
from streamload.errors import SaveError

_GROUPS: dict[tuple[int, ...], Any] = {}


def _group(ranks: tuple[int, ...]) -> Any:
    """A process group over ``ranks``, made once; every rank of the world calls this in the same order."""
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def _mesh(layout: str, rank: int, world: int) -> Any:
    """``own``: a one-rank mesh per rank; ``split``: ranks [0, 1] share a mesh, each other rank
    has its own (which holds the whole tensor, overlapping both of the first two's halves)."""
    from torch.distributed.device_mesh import DeviceMesh

    meshes = [(r,) for r in range(world)] if layout == "own" else [(0, 1)] + [(r,) for r in range(2, world)]
    groups = {m: _group(m) for m in meshes}
    mine = next(m for m in meshes if rank in m)
    return DeviceMesh.from_group(groups[mine], "cpu")


class _Small(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(10, 4, generator=g))
        self.b = nn.Parameter(torch.randn(6, generator=g))


def case_meshes(
    rank: int,
    world: int,
    *,
    out: str,
    layout: str,
    differ: bool,
    dtypes: tuple[str, ...] = (),
    save_dtype: str | None = None,
    digest_fails: int | None = None,
) -> dict[str, Any]:
    """Shards ``_Small`` (seeded by rank when ``differ``; held in ``dtypes[rank]`` when given)
    over ``_mesh(layout)`` and saves it over the world (cast to ``save_dtype``); the copies'
    digest raises on rank ``digest_fails``. Returns what the save reported or raised."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import streamload.save.tiling as tiling

    mesh = _mesh(layout, rank, world)
    model = _Small(seed=rank if differ else 0)
    if dtypes:
        model.to(getattr(torch, dtypes[rank]))
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name in ("w", "b"):
        setattr(model, name, nn.Parameter(distribute_tensor(getattr(model, name).data, mesh, [Shard(0)])))
    real = tiling._digest
    if digest_fails == rank:

        def digest(*args: Any) -> bytes:
            raise MemoryError("injected while hashing a copy")

        tiling._digest = digest
    dtype = getattr(torch, save_dtype) if save_dtype else None
    try:
        rep = streamload.save_pretrained(model, out, max_shard_size="5GB", writers="owners", dtype=dtype)
    except SaveError as exc:
        return {"error": str(exc), "tensor": exc.tensor, "rank": exc.rank, "ref": ref}
    finally:
        tiling._digest = real
    return {"bytes": rep.bytes_written, "ref": ref, "left": sorted(os.listdir(os.path.dirname(out)))}
