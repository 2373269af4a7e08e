"""Cases for the cold-read path, run inside the rank group (see rank_group.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cases_load import MISSING_PATH, compare_model, mesh_for, reference, tied

import streamload
from streamload.io import cold


def evicted_mesh(rank: int, ckpt: str, ws: int) -> tuple[Any, list[str]] | None:
    """The mesh over ranks [0, ws) (None elsewhere) once rank 0 evicted the checkpoint's files."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    group = mesh.get_group()
    paths = sorted(str(p) for p in Path(ckpt).glob("*.safetensors"))
    gc.collect()  # a previous case's model may still map the files: its pages could not be evicted
    dist.barrier(group=group)
    if rank == 0:
        cold.evict(paths)
    dist.barrier(group=group)
    return mesh, paths


@contextmanager
def recorded_engines(**engine_kwargs: Any) -> Iterator[list[cold.ColdEngine]]:
    """Inside: every ColdEngine made is kept in the yielded list (built with ``engine_kwargs``
    on top of the caller's); put back on the way out, so later cases in the same rank process
    make plain engines."""
    engines: list[cold.ColdEngine] = []
    made = cold.ColdEngine

    class Recorded(made):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, **engine_kwargs})
            engines.append(self)

    cold.ColdEngine = Recorded  # type: ignore[misc]
    try:
        yield engines
    finally:
        cold.ColdEngine = made  # type: ignore[misc]


def case_cold_load(
    rank: int,
    world: int,
    *,
    ckpt: str,
    ws: int,
    read_mode: str,
    readers: str = "src",
    drop_cache: bool = False,
    direct_io: bool | None = None,
    dtype: torch.dtype | None = None,
    nodes: int = 0,
) -> dict | None:
    """Evicts the files, loads with ``read_mode``, measures what stayed in the
    page cache, then compares every parameter with transformers. ``direct_io``:
    the load's keyword (True: O_DIRECT, False: buffered, None: the default);
    ``nodes``: simulated nodes (the ``node`` keyword), for ``readers="node"``."""
    ready = evicted_mesh(rank, ckpt, ws)
    if ready is None:
        return None
    mesh, paths = ready
    group = mesh.get_group()
    with recorded_engines() as engines:
        sees = readers != "src" or rank == 0
        model = streamload.from_pretrained(
            ckpt if sees else MISSING_PATH,
            device_mesh=mesh,
            dtype=dtype,
            bucket_bytes=4096,
            progress=False,
            readers=readers,
            read_mode=read_mode,
            drop_cache=drop_cache,
            direct_io=direct_io,
            node=str(rank * nodes // ws) if nodes else None,
        )
    dist.barrier(group=group)
    resident = cold.residency(paths)  # before transformers maps the files
    dist.barrier(group=group)
    ref = reference(ckpt, dtype)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    assert tied(model) == tied(ref)
    rep = model.streamload_report
    stats = [e.stats for e in engines]
    return {
        "resident": resident,
        "read_mode": rep.read_mode,
        "reader": rep.reader,
        "mapped": rep.bytes_mapped,
        # This rank's cold reads (None where it opened no cold checkpoint).
        "buffered": engines[-1].buffered if engines else None,
        "cold_reads": sum(st.reads for st in stats),
        "direct_reads": sum(st.direct_reads for st in stats),
        "direct_refused": any(st.direct_refused for st in stats),
        "in_place_bytes": sum(st.in_place_bytes for st in stats),
    }
