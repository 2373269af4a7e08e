"""Cases for read-ahead on the cold path, run inside the rank group (see rank_group.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from cases_cold import evicted_mesh, recorded_engines
from cases_load import MISSING_PATH, compare_model, reference, tied

import streamload
from streamload.timeline import observe


def _first(events: list[tuple[str, int, str]], step: str, bucket: int, what: str) -> int | None:
    return next((i for i, e in enumerate(events) if e == (step, bucket, what)), None)


def _first_step(events: list[tuple[str, int, str]], step: str, what: str) -> int:
    return next(i for i, e in enumerate(events) if e[0] == step and e[2] == what)


def _ahead(events: list[tuple[str, int, str]], buckets: int, step: str) -> tuple[int, int]:
    """(buckets k >= 1 whose first read was issued before bucket k-1's ``step`` ended,
    buckets k >= 1 that read anything at all)."""
    ahead = eligible = 0
    for k in range(1, buckets):
        read = _first(events, "read", k, "start")
        if read is None:
            continue  # nothing of this bucket on this rank
        eligible += 1
        end = _first(events, step, k - 1, "end")
        ahead += int(end is not None and read < end)
    return ahead, eligible


def case_read_ahead(
    rank: int,
    world: int,
    *,
    ckpt: str,
    ws: int,
    readers: str,
    chunk: int = 16 << 10,
    bucket: int = 64 << 10,
    direct_io: str | None = None,
    in_place: bool = True,
) -> dict[str, Any] | None:
    """Evicts the files, loads cold with small buckets and chunks while logging every
    step, compares with transformers, and returns what the log shows on this rank.
    ``direct_io``: STREAMLOAD_DIRECT_IO for the load ("1": O_DIRECT, default buffered);
    ``in_place``: the engine's (False: every read goes through the read buffers)."""
    ready = evicted_mesh(rank, ckpt, ws)
    if ready is None:
        return None
    mesh, paths = ready
    group = mesh.get_group()
    # The load's own engine with small chunks, kept for its figures.
    with recorded_engines(
        {"STREAMLOAD_DIRECT_IO": direct_io}, chunk_bytes=chunk, in_place=in_place
    ) as engines:
        sees = readers != "src" or rank == 0
        with observe() as tl:
            model = streamload.from_pretrained(
                ckpt if sees else MISSING_PATH,
                device_mesh=mesh,
                bucket_bytes=bucket,
                progress=False,
                readers=readers,
                read_mode="cold",
            )
    dist.barrier(group=group)
    ref = reference(ckpt, None)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    assert tied(model) == tied(ref)
    rep = model.streamload_report
    assert tl.events is not None
    # Buckets this rank packed or received (LoadReport.buckets counts collectives: none for owners).
    buckets = len({e[1] for e in tl.events if e[0] in ("pack", "scatter_wait")})
    out: dict[str, Any] = {"read_mode": rep.read_mode, "buckets": buckets}
    if engines:
        engine = engines[-1]
        out.update(
            ahead_of_pack=_ahead(tl.events, buckets, "pack"),
            ahead_of_scatter=_ahead(tl.events, buckets, "scatter_wait"),
            scattered=sum(1 for e in tl.events if e[0] == "scatter_wait" and e[2] == "end"),
            # Chunk reads issued before the first chunk was copied out: the pipeline's depth.
            reads_before_first_copy=sum(
                1 for e in tl.events[: _first_step(tl.events, "cold_copy", "end")] if e[0] == "read"
            ),
            reads=engine.stats.reads,
            peak_buffer_bytes=engine.peak_buffer_bytes,
            in_place_bytes=engine.stats.in_place_bytes,
            peak_staging_bytes=rep.peak_staging_bytes,
            bucket_bytes=rep.bucket_bytes,
            direct_reads=engine.stats.direct_reads,
            direct_refused=engine.stats.direct_refused,
            buffered=engine.buffered,
            file_bytes=sum(Path(p).stat().st_size for p in paths),
            disk_bytes_read=rep.disk_bytes_read,
            disk_reads=rep.disk_reads,
            phases=rep.phases,
        )
        engine.close()
    return out
