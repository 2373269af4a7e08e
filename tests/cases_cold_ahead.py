"""Cases for read-ahead on the cold path, run inside the rank group (see rank_group.py)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch.distributed as dist
from cases_load import MISSING_PATH, compare_model, mesh_for, reference, tied

import streamload
from streamload.io import cold
from streamload.timeline import observe


def _first(events: list[tuple[str, int, str]], step: str, bucket: int, what: str) -> int | None:
    return next((i for i, e in enumerate(events) if e == (step, bucket, what)), None)


def _ahead(events: list[tuple[str, int, str]], buckets: int, step: str) -> int:
    """Buckets k >= 1 whose first read was issued before bucket k-1's ``step`` ended."""
    count = 0
    for k in range(1, buckets):
        read = _first(events, "read", k, "start")
        end = _first(events, step, k - 1, "end")
        if read is not None and end is not None and read < end:
            count += 1
    return count


def case_read_ahead(
    rank: int, world: int, *, ckpt: str, ws: int, readers: str, chunk: int = 16 << 10
) -> dict[str, Any] | None:
    """Evicts the files, loads cold with small buckets and chunks while logging every
    step, compares with transformers, and returns what the log shows on this rank."""
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
    engines: list[cold.ColdEngine] = []
    made = cold.ColdEngine

    class Recorded(made):  # type: ignore[misc, valid-type]
        """The load's own engine with small chunks, kept for its figures."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["chunk_bytes"] = chunk
            super().__init__(*args, **kwargs)
            engines.append(self)

    cold.ColdEngine = Recorded  # type: ignore[misc]
    try:
        sees = readers != "src" or rank == 0
        with observe() as tl:
            model = streamload.from_pretrained(
                ckpt if sees else MISSING_PATH,
                device_mesh=mesh,
                bucket_bytes=64 << 10,
                progress=False,
                readers=readers,
                read_mode="cold",
            )
    finally:
        cold.ColdEngine = made  # type: ignore[misc]
    dist.barrier(group=group)
    ref = reference(ckpt, None)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    assert tied(model) == tied(ref)
    rep = model.streamload_report
    out: dict[str, Any] = {"read_mode": rep.read_mode, "buckets": rep.buckets}
    if engines:
        engine = engines[-1]
        assert tl.events is not None
        out.update(
            ahead_of_pack=_ahead(tl.events, rep.buckets, "pack"),
            ahead_of_scatter=_ahead(tl.events, rep.buckets, "scatter_wait"),
            peak_buffer_bytes=engine.peak_buffer_bytes,
            direct_reads=engine.stats.direct_reads,
            direct_refused=engine.stats.direct_refused,
            file_bytes=sum(Path(p).stat().st_size for p in paths),
            phases=rep.phases,
        )
        engine.close()
    return out
