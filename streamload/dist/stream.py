"""Stream: the bucket pipelines. ``scatter`` (one reader packs, the transport
delivers, every rank unpacks) and ``read_owned`` (every rank packs its own
shards from the files). Both carry the per-bucket error protocol."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .pack import Packer, StagingRing
from ..plan.buckets import Plan
from .protocol import StatusCheck, gather_or_raise
from ..report import progress_enabled
from ..io.sources import Source
from .transport import Transport
from .unpack import unpack


@dataclass
class Shards:
    """What a pipeline fills on this rank, and how it paces and reports it."""

    locals_: list[torch.Tensor]  # local shards, one per plan target
    fallbacks: Any  # materialised sources of conversions the planner cannot stream
    slots: int
    progress: bool | None
    skip: frozenset[int] = field(default_factory=frozenset)  # targets that need no copy (mapped)
    quant: dict[str, Any] = field(default_factory=dict)  # logical key -> QuantTensor (dequantized on pack)


class DeviceStager:
    """Pinned staging slot -> device buffer, on a dedicated copy stream.

    Events keep a pinned slot from being repacked before its copy finished,
    and the collective from starting before its bytes landed, so packing
    bucket k+2, copying k+1 to the device and scattering k overlap.
    """

    def __init__(self, slots: int, nbytes: int, device: torch.device) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.stream = torch.cuda.Stream(device)
        self.copied: list[Any] = [None] * slots

    def before_pack(self, k: int) -> None:
        """Waits until the pinned slot of bucket k is free again."""
        event = self.copied[k % len(self.buffers)]
        if event is not None:
            event.synchronize()

    def push(self, k: int, host: torch.Tensor) -> torch.Tensor:
        """Starts the host-to-device copy of bucket k; returns the device bytes."""
        buf = self.buffers[k % len(self.buffers)][: host.numel()]
        # The buffer's last collective was waited on the compute stream: order after it.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            buf.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied[k % len(self.buffers)] = event
        # NCCL waits on the current stream when the collective is enqueued.
        torch.cuda.current_stream().wait_event(event)
        return buf


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
) -> tuple[int, int]:
    """One reader (``source`` given on it only) -> every rank of ``group``.

    Returns:
        (staging peak bytes, bytes read) on this rank.
    """
    slots = shards.slots
    if device.type == "cpu":
        # The reader's own shards are filled from the files in place.
        plan.set_direct(src_group_rank)
    elif device.type == "cuda":
        slots = max(slots, 3)  # pack k+2, copy k+1 to the device, scatter k
    packer = (
        Packer(source, plan, shards.locals_, shards.fallbacks, shards.skip, shards.quant)
        if source is not None
        else None
    )
    peak = _stream(plan, group_rank, src_rank, group, device, packer, shards.locals_, slots, shards.progress)
    return peak, packer.bytes_read if packer is not None else 0


def read_owned(
    plan: Plan,
    source: Source | None,
    shards: Shards,
    group_rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[int, int]:
    """Every rank reads its own segments; no transport. Returns (peak, bytes read)."""
    assert source is not None
    status = StatusCheck(group, device)
    locals_ = shards.locals_
    packer = Packer(source, plan, locals_, shards.fallbacks, shards.skip, shards.quant)
    staging: StagingRing | None = None
    if device.type == "cpu":
        plan.set_direct(group_rank)
    elif plan.buckets:
        staging = StagingRing(1, plan.max_rank_bucket_bytes(group_rank), pin=device.type == "cuda")
    failure: BaseException | None = None
    previous = None
    bar = _progress_bar(sum(s.nbytes for b in plan.buckets for s in b.segments[group_rank]), shards.progress)
    try:
        for bucket in plan.buckets:
            try:
                packer.check_source()
                if staging is None:
                    packer.pack(bucket, torch.empty(0, dtype=torch.uint8), only=group_rank)
                else:
                    wire = packer.pack(bucket, staging[0], only=group_rank)
                    unpack(bucket, group_rank, wire.to(device, non_blocking=True), locals_)
                if bar is not None:
                    bar.update(sum(s.nbytes for s in bucket.segments[group_rank]))
            except BaseException as exc:  # noqa: BLE001 - reported to every rank below
                failure = exc
            if previous is not None and status.result(previous):
                break
            previous = status.post(failure is not None)
            if failure is not None:
                break
        failed = status.result(previous) if previous is not None else False
        if failure is not None or failed or status.any_failed(failure is not None):
            gather_or_raise(None, failure, group_rank, group, device)
    finally:
        if bar is not None:
            bar.close()
    return (staging.peak_bytes if staging else 0), packer.bytes_read


def _stream(
    plan: Plan,
    rank: int,
    src_rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    packer: Packer | None,
    locals_: list[torch.Tensor],
    slots: int,
    progress: bool | None,
) -> int:
    """Runs the bucket pipeline; returns the staging ring's peak bytes (reader)."""
    transport = Transport(group, src_rank, device)
    ring: StagingRing | None = None
    stager: DeviceStager | None = None
    if packer is not None and plan.buckets:
        pin = device.type == "cuda"
        ring = StagingRing(min(slots, len(plan.buckets)), plan.max_bucket_bytes, pin=pin)
        packer.bytes_read = 0
        if device.type == "cuda":
            stager = DeviceStager(len(ring.slots), plan.max_bucket_bytes, device)
    recv_len = plan.max_rank_bucket_bytes(transport.rank)
    # Receivers hold one receive buffer (the memory contract); the reader keeps
    # `slots` buckets in flight so packing k+1 overlaps the transport of k.
    depth = max(1, min(slots, len(plan.buckets))) if packer is not None else 1
    recv_ring = [
        torch.empty(recv_len, dtype=torch.uint8, device=device) for _ in range(depth if recv_len else 1)
    ]
    bar = _progress_bar(plan.payload_bytes, progress) if packer is not None else None
    inflight: deque[tuple[int, torch.Tensor, Any]] = deque()
    status = StatusCheck(group, device)
    failure: BaseException | None = None

    def finish(unpack_it: bool = True) -> None:
        k, recv, handle = inflight.popleft()
        Transport.wait(handle)
        if unpack_it:
            unpack(plan.buckets[k], transport.rank, recv, locals_)

    previous: tuple[Any, torch.Tensor] | None = None  # the status all-reduce of the last bucket
    try:
        for k, bucket in enumerate(plan.buckets):
            send = None
            try:
                if len(inflight) == depth:
                    finish()
                if packer is not None and ring is not None:
                    packer.check_source()
                    if stager is not None:
                        stager.before_pack(k)
                    send = packer.pack(bucket, ring[k])
                    if stager is not None:
                        send = stager.push(k, send)
                    if bar is not None:
                        bar.update(sum(seg.nbytes for segs in bucket.segments for seg in segs))
            except BaseException as exc:  # noqa: BLE001 - reported to every rank below
                failure = exc
            # All ranks read the same verdict on bucket k-1 here, so all stop at the same bucket.
            if previous is not None and status.result(previous):
                break
            previous = status.post(failure is not None)
            if send is None and ring is not None:
                # A failed pack still takes part in the collective it announced.
                send = stager.buffers[k % len(stager.buffers)] if stager is not None else ring[k]
            recv = recv_ring[k % len(recv_ring)][: bucket.wire_bytes(transport.rank)]
            inflight.append((k, recv, transport.start(bucket, send, recv)))
        else:
            failed = previous is not None and status.result(previous)
            if not failed:
                try:
                    while inflight:
                        finish()
                except BaseException as exc:  # noqa: BLE001
                    failure = exc
                failed = status.any_failed(failure is not None)
            if not failed:
                return ring.peak_bytes if ring is not None else 0
        # Someone failed: finish the collectives already posted, then agree on the error.
        while inflight:
            finish(unpack_it=False)
        gather_or_raise(None, failure, transport.rank, group, device)
        raise RuntimeError("unreachable: a failure was signalled but none was gathered")
    finally:
        if bar is not None:
            bar.close()
        if device.type == "cuda":
            # Give the staging and receive buffers back, cached blocks included.
            del recv_ring, stager
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
