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
    direct_io: bool | None = None,
    in_place: bool = True,
) -> dict[str, Any] | None:
    """Evicts the files, loads cold with small buckets and chunks while logging every
    step, compares with transformers, and returns what the log shows on this rank.
    ``direct_io``: the load's keyword (True: O_DIRECT, default buffered);
    ``in_place``: the engine's (False: every read goes through the read buffers)."""
    ready = evicted_mesh(rank, ckpt, ws)
    if ready is None:
        return None
    mesh, paths = ready
    group = mesh.get_group()
    # The load's own engine with small chunks, kept for its figures.
    with recorded_engines(chunk_bytes=chunk, in_place=in_place) as engines:
        sees = readers != "src" or rank == 0
        with observe() as tl:
            model = streamload.from_pretrained(
                ckpt if sees else MISSING_PATH,
                device_mesh=mesh,
                bucket_bytes=bucket,
                progress=False,
                readers=readers,
                read_mode="cold",
                direct_io=direct_io,
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


def case_failure_drains_reads_ahead(
    rank: int, world: int, *, ckpt: str, ws: int, readers: str
) -> dict[str, Any] | None:
    """Rank 1 fails at its second bucket (``src``: unpacking it; ``owners``: packing it)
    while the readers have the next bucket's reads announced, which land in staging slots
    and shards. Returns, per rank, the error raised and whether its engine still had reads
    queued or running when the load returned (none may outlive the load: the memory they
    write into is freed with it)."""
    import streamload.load.prepare as prepare
    import streamload.transport.stream as stream
    from streamload.transport.pack import Packer

    ready = evicted_mesh(rank, ckpt, ws)
    if ready is None:
        return None
    mesh, _ = ready
    real_pack, real_unpack = Packer.pack, stream.unpack
    calls = {"n": 0}

    def fail_second(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:
                raise streamload.CheckpointFileError("injected on rank 1", ckpt, "bucket 1")
            return real(*args, **kwargs)

        return call

    # Owners on the CPU read in one bucket of 1 GiB (nothing to read ahead across): this
    # test's buckets are small for every mode, so that the next bucket is announced.
    owners_bucket, prepare.OWNERS_CPU_BUCKET_BYTES = prepare.OWNERS_CPU_BUCKET_BYTES, 0
    if rank == 1:
        if readers == "src":
            stream.unpack = fail_second(real_unpack)
        else:
            Packer.pack = fail_second(real_pack)  # type: ignore[method-assign]
    error = None
    with recorded_engines(chunk_bytes=8192, direct_io=False) as engines:
        try:
            streamload.from_pretrained(
                ckpt if readers != "src" or rank == 0 else MISSING_PATH,
                device_mesh=mesh,
                bucket_bytes=64 << 10,
                progress=False,
                readers=readers,
                read_mode="cold",
            )
        except streamload.CheckpointFileError as exc:
            error = (type(exc).__name__, exc.rank)
        except BaseException as exc:  # noqa: BLE001 - reported, after the barrier every rank reaches
            error = (type(exc).__name__, repr(exc))
        finally:
            stream.unpack, Packer.pack = real_unpack, real_pack  # type: ignore[method-assign]
            prepare.OWNERS_CPU_BUCKET_BYTES = owners_bucket
    pending = [
        (len(e._ahead._batches), sum(not f.done() for b in e._ahead._batches for f in b.futures))
        for e in engines
    ]
    for e in engines:
        e.close()
    dist.barrier(group=mesh.get_group())
    return {"error": error, "engines": len(engines), "pending": pending}


def case_reads_never_land_in_a_slot_in_flight(
    rank: int, world: int, *, ckpt: str, ws: int, slots: int
) -> dict[str, Any] | None:
    """A cold ``src`` load with ``slots`` slots and small buckets; on the reader, every read
    that lands in a destination is checked, when it is issued, against the staging slots
    whose transport is still in flight (started, not yet waited for). Returns the reads that
    landed and the ones that hit a slot in flight (must be none)."""
    from streamload.io import cold
    from streamload.transport.collectives import Transport

    ready = evicted_mesh(rank, ckpt, ws)
    if ready is None:
        return None
    mesh, _ = ready
    flight: dict[int, tuple[int, int]] = {}  # id(handle) -> [start, end) of the bytes it sends
    seen = {"landed": 0, "hits": 0}
    real_start, real_wait, real_pick = Transport.start, Transport.wait, cold.ColdEngine._in_place

    def start(self: Transport, bucket: Any, send: Any, recv: Any) -> Any:
        handle = real_start(self, bucket, send, recv)
        if send is not None and handle is not None:
            flight[id(handle)] = (send.data_ptr(), send.data_ptr() + bucket.wire_total)
        return handle

    def wait(handle: Any) -> None:
        real_wait(handle)
        flight.pop(id(handle), None)

    def pick(self: cold.ColdEngine, rows: Any, a: Any, b: Any, isz: Any) -> Any:
        own = real_pick(self, rows, a, b, isz)
        starts = rows[own, 4] + rows[own, 9] * isz[own]  # destination address + offset in bytes
        for lo, n in zip(starts.tolist(), (b - a)[own].tolist(), strict=True):
            seen["landed"] += 1
            seen["hits"] += any(s < lo + n and lo < e for s, e in list(flight.values()))
        return own

    Transport.start, Transport.wait = start, staticmethod(wait)  # type: ignore[method-assign, assignment]
    cold.ColdEngine._in_place = pick  # type: ignore[method-assign]
    try:
        with recorded_engines(chunk_bytes=8192, direct_io=False):
            model = streamload.from_pretrained(
                ckpt if rank == 0 else MISSING_PATH,
                device_mesh=mesh,
                bucket_bytes=64 << 10,
                slots=slots,
                progress=False,
                readers="src",
                read_mode="cold",
            )
    finally:
        Transport.start, Transport.wait = real_start, staticmethod(real_wait)  # type: ignore[method-assign, assignment]
        cold.ColdEngine._in_place = real_pick  # type: ignore[method-assign]
    dist.barrier(group=mesh.get_group())
    assert not compare_model(model, reference(ckpt, None))
    return {**seen, "staging": model.streamload_report.peak_staging_bytes}
