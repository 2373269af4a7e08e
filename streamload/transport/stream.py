"""Stream: the bucket pipelines. ``scatter`` (one reader packs, the transport
delivers, every rank unpacks) and ``read_owned`` (every rank packs its own
shards from the files). Both carry the per-bucket error protocol."""

from __future__ import annotations

import functools
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..io.sources import Source
from ..plan.buckets import Bucket, Plan, split_direct
from ..report import progress_enabled
from ..timeline import current
from .arrival import raise_if_lost
from .collectives import Transport
from .pack import Packer, StagingRing
from .prefault import populate_on_copy, prefault
from .protocol import StatusRoute, gather_or_raise, open_status_route
from .staging import Stager, open_stager, settle
from .unpack import unpack

_NO_SLOT = torch.empty(0, dtype=torch.uint8)  # packing straight into the shards: no staging slot


@dataclass
class Shards:
    """What a pipeline fills on this rank, and how it paces and reports it."""

    locals_: list[torch.Tensor]  # local shards, one per plan target
    fallbacks: Any  # materialised sources of conversions the planner cannot stream
    slots: int
    progress: bool | None
    skip: frozenset[int] = field(default_factory=frozenset)  # targets that need no copy (mapped)
    quant: dict[str, Any] = field(default_factory=dict)  # logical key -> QuantTensor (dequantized on pack)
    prefault: bool | None = None  # the load's keyword (prefault.py; None: not given)
    # Targets whose shards live on the host in a device load (FSDP2 CPU offload): filled in place.
    host: frozenset[int] = field(default_factory=frozenset)
    # Set by the pipeline: "pinned", "pageable" (page-locking refused, see staging.py) or "" (none).
    staging: str = ""


def _progress_bar(total: int, enabled: bool | None) -> Any:
    if not progress_enabled(enabled):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="streamload")


def scatter(
    plan: Plan,
    group_rank: int,
    src_group_rank: int,
    src_rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    source: Source | None,
    shards: Shards,
    status: StatusRoute | None = None,
    served: list[int] | None = None,
) -> tuple[int, int]:
    """One reader (``source`` given on it only) -> every rank of ``group``.

    Args:
        status: where the per-bucket status flags travel (default: ``group``; see ``open_status_route``).
        served: the group ranks ``plan``'s rows stand for (default: every rank of ``group``);
            the reader's plan must cover every rank, a receiver's may be its own row alone.

    Returns:
        (staging peak bytes, bytes read) on this rank.
    """
    slots = shards.slots
    rows = served if served is not None else list(range(plan.world_size))
    row = rows.index(group_rank)
    if device.type == "cpu":
        # The reader's own shards are filled from the files in place.
        plan.set_direct(rows.index(src_group_rank) if src_group_rank in rows else None)
    else:
        slots = max(slots, 3)  # pack k+2, copy k+1 to the device, scatter k
    packer: Packer | None = None
    setup: BaseException | None = None  # agreed with the buffers, before the first bucket
    try:
        if source is not None:
            packer = Packer(source, plan, shards.locals_, shards.fallbacks, shards.skip, shards.quant)
            packer.announce_reads()
            # Off for a GPU's pinned staging slots: written over and over, their pages stay in.
            populate_on_copy(source.engine, shards.prefault if device.type == "cpu" else False)
    except BaseException as exc:  # noqa: BLE001 - every rank must hear of it (see _stream)
        setup = exc
    status = status or open_status_route(group, device, create=False)
    # Fresh CPU shards (not the mapped ones) are faulted in while the pipeline waits (prefault.py).
    fresh = [t for i, t in enumerate(shards.locals_) if i not in shards.skip] if device.type == "cpu" else []
    try:
        worker = prefault(fresh, shards.prefault)
    except Exception as exc:  # noqa: BLE001 - advisory: pages fault in at first write instead
        worker = None
        warnings.warn(f"streamload: shards are not faulted in ahead: {exc}", stacklevel=2)
    try:
        peak, shards.staging = _stream(
            plan, row, src_rank, group, device, packer, shards.locals_, slots, shards.progress, status, rows,
            setup,
        )  # fmt: skip
    finally:
        if worker is not None:
            worker.join()
    return peak, packer.bytes_read if packer is not None else 0


def read_owned(
    plan: Plan,
    source: Source | None,
    shards: Shards,
    group_rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    status: StatusRoute | None = None,
    row: int | None = None,
) -> tuple[int, int]:
    """Every rank reads its own segments; no transport. Returns (peak, bytes read).

    ``row`` is this rank's row in ``plan`` when the plan covers fewer ranks
    than the group (an owners plan is this rank's alone); default ``group_rank``.

    Shards on the CPU are filled straight from the files. Elsewhere bucket k is
    packed into a host slot, copied to the device on the copy stream and
    unpacked on the compute stream, while bucket k+1 is packed into the next
    slot (at least two; see ``Stager``).
    """
    row = group_rank if row is None else row
    me = dist.get_rank() if group is not None else 0  # errors name global ranks, as prepare's do
    assert source is not None
    route = status or open_status_route(group, device, create=False)
    check = route.check()
    locals_ = shards.locals_
    bar: Any = None
    stager: Stager | None = None
    split: list[tuple[Bucket | None, Bucket]] | None = None  # per bucket: filled in place, staged
    allocation: BaseException | None = None
    packer: Packer | None = None
    tl = current()
    try:
        with tl.span("setup"):
            packer = Packer(source, plan, locals_, shards.fallbacks, shards.skip, shards.quant)
            packer.announce_reads(row)
            populate_on_copy(source.engine, shards.prefault if device.type == "cpu" else False)
            bar = _progress_bar(sum(s.nbytes for b in plan.buckets for s in b.segments[row]), shards.progress)
            # Shards on the CPU are filled in place: nothing stages there. Nor do the host's shards
            # (FSDP2 offload) in a load whose other shards are staged to the device: each bucket is
            # split into the part filled in place and the part staged.
            split = [split_direct(b, row, shards.host) for b in plan.buckets] if shards.host else None
            staged = max((b.rank_bytes[row] for _, b in split), default=0) if split else 0
            if plan.buckets and (split is None or staged):
                on_cpu = all(t.device.type == "cpu" for t in locals_)
                at = torch.device("cpu") if on_cpu else device
                stager = open_stager(at, max(shards.slots, 2), staged or plan.max_rank_bucket_bytes(row))
                shards.staging = stager.staging if stager is not None else ""
    except BaseException as exc:  # noqa: BLE001 - every rank must hear of it
        allocation = exc
    with tl.span("agree_buffers"):
        _agree_on_buffers(check, allocation, [stager], me, route)
    assert packer is not None
    if stager is None:
        plan.set_direct(row)
    failure: BaseException | None = None
    previous = None
    try:
        for k, bucket in enumerate(plan.buckets):
            tl.bucket = k
            try:
                packer.check_source()
                with tl.span("pack", k):
                    if stager is None:
                        # Shards are filled in place: the next bucket's reads may start now.
                        nxt = plan.buckets[k + 1] if k + 1 < len(plan.buckets) else None
                        packer.upcoming = (nxt, _NO_SLOT) if nxt is not None else None
                        packer.pack(bucket, _NO_SLOT, only=row)
                    else:
                        in_place, part = split[k] if split is not None else (None, bucket)
                        if in_place is not None:
                            packer.pack(in_place, _NO_SLOT, only=row)
                        if part.rank_bytes[row]:
                            wire = packer.pack(part, stager.host(k), only=row)
                            dev = stager.push(k, wire)
                            stager.on_compute(functools.partial(unpack, part, row, dev, locals_))
                            stager.consumed(k)
                if bar is not None:
                    bar.update(sum(s.nbytes for s in bucket.segments[row]))
            except BaseException as exc:  # noqa: BLE001 - reported to every rank below
                raise_if_lost(exc)  # a peer is gone: no status check or agreement can complete
                failure = exc
            with tl.span("status", k):
                if previous is not None and check.result(previous):
                    break
                previous = check.post(failure is not None)
            if failure is not None:
                break
        # A rank that failed in the loop announced it in its last flag: every rank reads it here.
        failed = check.result(previous) if previous is not None else False
        if not failed:
            # The device's queued copies may fail too: waited for before the last agreement.
            with tl.span("agree_end"):
                try:
                    settle(device, stager)
                except BaseException as exc:  # noqa: BLE001 - reported to every rank below
                    raise_if_lost(exc)  # a peer is gone: no status check or agreement can complete
                    failure = exc
                failed = check.any_failed(failure is not None)
        if failed:
            # On the status route: a rank whose device faulted cannot enter an NCCL collective.
            gather_or_raise(None, failure, me, route.group, route.device)
            raise RuntimeError("unreachable: a failure was signalled but none was gathered")
    finally:
        try:
            # A stop before the last bucket (this rank's failure or another's) leaves the next
            # bucket's reads landing in the shards: they end here, before the shards may go.
            _drain_quietly(packer)
        finally:
            if bar is not None:
                bar.close()
            _close_quietly(stager)
    return (stager.peak_bytes if stager else 0), packer.bytes_read


def _stream(
    plan: Plan,
    row: int,
    src_rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    packer: Packer | None,
    locals_: list[torch.Tensor],
    slots: int,
    progress: bool | None,
    status: StatusRoute,
    rows: list[int],
    setup: BaseException | None = None,
) -> tuple[int, str]:
    """Runs the bucket pipeline; returns the staging ring's peak bytes (reader) and how its
    host slots were held (``Shards.staging``).

    ``row`` is this rank's row in ``plan``; ``rows`` the group rank of each row (see ``scatter``).
    ``setup``: this rank's failure before the pipeline (its packer), agreed with the buffers.
    """
    transport: Transport | None = None
    bar: Any = None
    ring: StagingRing | None = None
    stager: Stager | None = None
    check = status.check()
    recv_len = plan.max_rank_bucket_bytes(row)
    # Receivers hold one receive buffer (the memory contract); the reader keeps
    # `slots` buckets in flight so packing k+1 overlaps the transport of k.
    depth = max(1, min(slots, len(plan.buckets))) if packer is not None else 1
    recv_ring: list[torch.Tensor] = []
    allocation: BaseException | None = setup
    tl = current()
    try:
        with tl.span("setup"):
            transport = Transport(group, src_rank, device, rows if packer is not None else None)
            if packer is not None and plan.buckets:
                stager = open_stager(device, depth, plan.max_bucket_bytes)
                if stager is None:
                    # Bucket k+1's reads may land in its slot while bucket k is packed and buckets
                    # k-depth+1..k-1 are in flight: then the ring holds one slot more than that.
                    ahead = packer.lands_ahead and len(plan.buckets) > depth
                    ring = StagingRing(depth + 1 if ahead else depth, plan.max_bucket_bytes)
                packer.bytes_read = 0
            recv_ring = [
                torch.empty(recv_len, dtype=torch.uint8, device=device)
                for _ in range(depth if recv_len else 1)
            ]
            bar = _progress_bar(plan.payload_bytes, progress) if packer is not None else None
    except BaseException as exc:  # noqa: BLE001 - every rank must hear of it
        allocation = exc
    me = dist.get_rank() if group is not None else 0  # errors name global ranks, as prepare's do
    with tl.span("agree_buffers"):
        _agree_on_buffers(check, allocation, [stager], me, status)
    assert transport is not None
    inflight: deque[tuple[int, torch.Tensor, Any]] = deque()
    failure: BaseException | None = None

    def finish(unpack_it: bool = True) -> None:
        k, recv, handle = inflight.popleft()
        with tl.span("scatter_wait", k):
            Transport.wait(handle)
        if stager is not None:
            stager.consumed(k)  # the collective that read bucket k's device bytes is done
        if unpack_it:
            with tl.span("unpack", k):
                unpack(plan.buckets[k], row, recv, locals_)

    previous: tuple[Any, torch.Tensor] | None = None  # the status all-reduce of the last bucket
    try:
        for k, bucket in enumerate(plan.buckets):
            send = None
            tl.bucket = k
            try:
                if len(inflight) == depth:
                    finish()
                # After a failure, buckets up to the agreed stop move without being packed.
                if failure is None and packer is not None and (ring is not None or stager is not None):
                    packer.check_source()
                    with tl.span("pack", k):
                        if stager is not None:
                            send = stager.push(k, packer.pack(bucket, stager.host(k)))
                        else:
                            assert ring is not None
                            # Bucket k+1's reads may start now. They land in its slot only
                            # where the ring has a slot more than buckets in flight (then no
                            # transport reads that slot); else in the engine's read buffers.
                            last = k + 1 == len(plan.buckets)
                            packer.upcoming = None if last else (plan.buckets[k + 1], ring[k + 1])
                            send = packer.pack(bucket, ring[k])
                    if bar is not None:
                        bar.update(sum(seg.nbytes for segs in bucket.segments for seg in segs))
            except BaseException as exc:  # noqa: BLE001 - reported to every rank below
                raise_if_lost(exc)  # a peer is gone: no status check or agreement can complete
                failure = exc
            # All ranks read the same verdict on bucket k-1 here, so all stop at the same bucket.
            with tl.span("status", k):
                if previous is not None and check.result(previous):
                    break
                previous = check.post(failure is not None)
            if send is None and packer is not None:
                # A failed pack still takes part in the collective it announced.
                send = stager.device(k) if stager is not None else ring[k] if ring is not None else None
            recv = recv_ring[k % len(recv_ring)][: bucket.wire_bytes(row)]
            try:
                handle = transport.start(bucket, send, recv)
            except BaseException as exc:  # noqa: BLE001 - announced with the next status flag
                raise_if_lost(exc)  # a peer is gone: no status check or agreement can complete
                # The other ranks launch bucket k whatever happened here: a launch that failed
                # before reaching the wire is replaced by one that can only move zeros, so no
                # rank waits for it; the failure stops every rank at the next status check.
                failure = failure or exc
                zeros = torch.zeros(bucket.wire_total, dtype=torch.uint8, device=device)
                handle = transport.start(bucket, zeros if packer is not None else None, recv)
            inflight.append((k, recv, handle))
        else:
            failed = previous is not None and check.result(previous)
            if not failed:
                try:
                    while inflight:
                        finish()
                    settle(device, stager)
                except BaseException as exc:  # noqa: BLE001
                    raise_if_lost(exc)  # a peer is gone: no status check or agreement can complete
                    failure = exc
                failed = check.any_failed(failure is not None)
            if not failed:
                if stager is not None:
                    return stager.peak_bytes, stager.staging
                return (ring.peak_bytes if ring is not None else 0), ""
        # Someone failed: finish the collectives already posted, then agree on the error.
        while inflight:
            try:
                finish(unpack_it=False)
            except BaseException as exc:  # noqa: BLE001 - this rank still joins the agreement
                raise_if_lost(exc)  # a peer is gone: no status check or agreement can complete
                failure = failure or exc
        # On the status route: a rank whose device faulted cannot enter an NCCL collective.
        gather_or_raise(None, failure, me, status.group, status.device)
        raise RuntimeError("unreachable: a failure was signalled but none was gathered")
    finally:
        try:
            _drain_quietly(packer)  # reads of the next bucket may be landing in its slot (see read_owned)
        finally:
            if bar is not None:
                bar.close()
            _close_quietly(stager)  # waits for its copies, unregisters its host slots
            # The receive buffers go back to torch's caching allocator (never empty_cache()).
            del recv_ring


def _agree_on_buffers(
    check: Any,
    failure: BaseException | None,
    stagers: list[Stager | None],
    rank: int,
    route: StatusRoute,
) -> None:
    """One status exchange after the staging and receive buffers are allocated:
    an allocation that fails on one rank (out of memory, a device that faulted)
    is raised on every rank, before any rank enters the first bucket's collective.
    The error travels on ``route`` (the gloo side group on NCCL), never on the device."""
    if not check.any_failed(failure is not None):
        return
    for stager in stagers:
        _close_quietly(stager)  # page-locked host slots are never left behind
    gather_or_raise(None, failure, rank, route.group, route.device)
    raise RuntimeError("unreachable: a failure was signalled but none was gathered")


def _drain_quietly(packer: Packer | None) -> None:
    """Waits for the reads still in flight; a failure to is a warning, not an error: on a
    failed load the agreed error is already on its way (this rank must raise that one), and
    after a load every rank agreed on, raising here alone would leave the ranks disagreeing."""
    if packer is None:
        return
    try:
        packer.drain()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        warnings.warn(f"streamload: reads in flight could not be waited for: {exc}", stacklevel=2)


def _close_quietly(stager: Stager | None) -> None:
    """Gives the staging buffers back; a failure to do so is a warning, not an error,
    because it happens after the ranks agreed that the load succeeded (raising on
    this rank alone would leave the ranks disagreeing on the outcome)."""
    if stager is None:
        return
    try:
        stager.close()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        warnings.warn(f"streamload: staging buffers could not be released: {exc}", stacklevel=2)
