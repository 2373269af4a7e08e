"""Cases for missing tensors initialised under FSDP2 (issue #43 item 6), run inside the
rank group (see rank_group.py): no DTensor random op, no collective, the same values
on every rank, mesh and world size.

torch creates its ``OffsetBasedRNGTracker`` (which broadcasts an RNG state over the
default group) at the first DTensor random op on a mesh whose device has
``set_rng_state``: CUDA, not the CPU. These cases make the CPU mesh look like one to
torch's dispatcher (``is_rng_supported_mesh``) and put a recording stand-in where the
tracker would be created, so the CPU shows what a CUDA mesh would do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from cases_load import MISSING_PATH, full, mesh_for

import streamload

# What fill_uncovered must never call, each a collective over some group.
COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "scatter", "barrier")


class RecordingTracker:
    """Stands where torch would create its OffsetBasedRNGTracker: records each creation."""

    created: list[str] = []

    def __init__(self, device_mesh: Any, run_state_sync: bool = True) -> None:
        RecordingTracker.created.append(str(device_mesh.device_type))
        self.distribute_region_enabled = False  # the random op then runs on the local shard as is

    @contextlib.contextmanager
    def _distribute_region(self, spec: Any, generator: Any = None) -> Iterator[None]:
        yield


@contextlib.contextmanager
def cpu_mesh_as_cuda() -> Iterator[None]:
    """torch's DTensor dispatch treats the CPU mesh as RNG-capable and creates ``RecordingTracker``."""
    import torch.distributed.tensor._dispatch as dispatch
    import torch.distributed.tensor._random as random

    saved = dispatch.is_rng_supported_mesh, random.OffsetBasedRNGTracker, random._rng_tracker
    dispatch.is_rng_supported_mesh = lambda mesh: True
    random.OffsetBasedRNGTracker = RecordingTracker  # type: ignore[misc,assignment]
    random._rng_tracker = None
    RecordingTracker.created.clear()
    try:
        yield
    finally:
        dispatch.is_rng_supported_mesh, random.OffsetBasedRNGTracker, random._rng_tracker = saved


@contextlib.contextmanager
def counting_fill(calls: list[str]) -> Iterator[None]:
    """Records every collective called while the load's ``fill_uncovered`` runs."""
    import streamload.load.prepare as prepare

    real_fill = prepare.fill_uncovered

    def fill(*args: Any, **kwargs: Any) -> Any:
        real = {name: getattr(dist, name) for name in COLLECTIVES}

        def counted(name: str) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                calls.append(name)
                return real[name](*a, **k)

            return call

        for name in COLLECTIVES:
            setattr(dist, name, counted(name))
        try:
            return real_fill(*args, **kwargs)
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)

    prepare.fill_uncovered = fill
    try:
        yield
    finally:
        prepare.fill_uncovered = real_fill


def _meta_sharded(ckpt: str, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamload.model.state import rebind_ties, record_state

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    rebind_ties(model, record_state(model).ties)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def case_missing_init(rank: int, world: int, *, ckpt: str, ws: int, missing: list[str]) -> dict | None:
    """A strict=False load of a checkpoint that lacks ``missing``, on ranks [0, ws) of the
    world (a subgroup load when ws < world), each rank seeded differently: rank 0's seed decides."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    torch.manual_seed(1000 + rank)  # only the reader's (rank 0's) initial seed may matter
    state_before = torch.get_rng_state()
    model = _meta_sharded(ckpt, mesh)
    calls: list[str] = []
    with cpu_mesh_as_cuda(), counting_fill(calls):
        report = streamload.load_checkpoint(
            model, ckpt if rank == 0 else MISSING_PATH, device_mesh=mesh, strict=False, progress=False
        )
    rng_kept = torch.equal(torch.get_rng_state(), state_before)
    values = {n: full(model.get_parameter(n)).detach().clone() for n in missing}
    return {
        "missing": sorted(report.missing_keys),
        "trackers": list(RecordingTracker.created),
        "collectives": calls,
        "rng_kept": rng_kept,
        "values": values,
    }
