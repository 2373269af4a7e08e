"""Transport: torch.distributed moves each bucket from the reader to the
owners (NCCL on GPUs, gloo on CPUs). One collective per bucket, never one per
tensor; receivers get only their own bytes."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from ..options import force_multi_rank
from ..plan.buckets import Bucket
from .arrival import wait_work


def solo(group: dist.ProcessGroup | None) -> bool:
    """True when ``group`` needs no collective: None (no torch.distributed) or one rank, unless
    ``STREAMLOAD_FORCE_MULTI_RANK`` makes a group of one take the paths of many (the device check)."""
    return group is None or (dist.get_world_size(group) == 1 and not force_multi_rank())


class Transport:
    """Scatters packed buckets from ``src`` with ``all_to_all_single``.

    Uneven splits let each rank receive exactly its bytes (no padding to
    the largest rank), and the same call serves a later mode where several
    ranks read.

    Args:
        group: the process group (None: no torch.distributed, one process).
        src: global rank of the reader.
        device: where the wire buffers live (cuda for NCCL, cpu for gloo).
        rows: on the reader, the group rank each row of its plan stands for, ascending (the
            packed bucket holds the rows in order, and ``all_to_all_single`` takes each
            destination's bytes in group rank order); default every rank of ``group``.
            Ranks of no row (another node's) get nothing from this reader.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, src: int, device: torch.device, rows: list[int] | None = None
    ) -> None:
        self.group = group
        self.src = src
        self.device = device
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1
        self.group_src = dist.get_group_rank(group, src) if group is not None else 0
        self.rows = list(range(self.world)) if rows is None else list(rows)
        if self.rows != sorted(set(self.rows) & set(range(self.world))):
            raise ValueError(
                f"plan rows must be distinct ascending ranks of a {self.world}-rank group: {self.rows}"
            )

    def start(self, bucket: Bucket, send: torch.Tensor | None, recv: torch.Tensor) -> Any:
        """Starts moving ``bucket``; returns a handle for ``wait``.

        Args:
            bucket: the plan's bucket (on the reader, a plan over every rank: its per-rank
                byte counts are the send splits).
            send: the packed bytes on the reader (None elsewhere).
            recv: this rank's receive buffer, exactly its byte count long: a receiver's
                plan knows its own bytes only, so its split is the buffer's length.
        """
        if solo(self.group):
            if send is not None:
                recv.copy_(send[: recv.numel()])
            return None
        out_splits = [0] * self.world
        out_splits[self.group_src] = recv.numel()
        if self.rank == self.group_src:
            assert send is not None
            in_splits = [0] * self.world
            for row, r in enumerate(self.rows):
                in_splits[r] = bucket.wire_bytes(row)
            inp = send[: bucket.wire_total]
        else:
            in_splits = [0] * self.world
            inp = torch.empty(0, dtype=torch.uint8, device=self.device)
        work = dist.all_to_all_single(recv, inp, out_splits, in_splits, group=self.group, async_op=True)
        return (work, self.device)

    @staticmethod
    def wait(handle: Any) -> None:
        """Waits for what ``start`` returned (see ``arrival.wait_work``)."""
        if handle is not None:
            wait_work(*handle)


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None, device: torch.device) -> Any:
    """Sends a picklable object from ``src`` to every rank (one collective)."""
    if solo(group):
        return obj
    # Pickled by hand and waited for with ``wait_work`` (see ``all_gather_object``).
    mine = dist.get_rank() == src
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if mine else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=device)
    wait_work(dist.broadcast(size, src=src, group=group, async_op=True), device)
    buf = (
        data.to(device)
        if data is not None
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    wait_work(dist.broadcast(buf, src=src, group=group, async_op=True), device)
    return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())


def all_gather_object(obj: Any, group: dist.ProcessGroup | None, device: torch.device) -> list[Any]:
    """Every rank's ``obj``, in group rank order."""
    if solo(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    # Pickled by hand (all_gather_object on NCCL needs the current device set), and waited for
    # with ``wait_work``: a peer that left a broken call is noticed instead of waited for.
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], device=device)
    sizes = [torch.zeros_like(size) for _ in out]
    wait_work(dist.all_gather(sizes, size, group=group, async_op=True), device)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in out]
    wait_work(dist.all_gather(gathered, padded, group=group, async_op=True), device)
    return [
        pickle.loads(g[: int(s.item())].cpu().numpy().tobytes()) for g, s in zip(gathered, sizes, strict=True)
    ]
