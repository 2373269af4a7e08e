"""The ``src`` writer: one rank writes the files, every rank sends it its pieces.

For output directories that only the writing rank sees (node-local disks).
Each rank packs its pieces exactly as the ``owners`` writer does (same
packer, file order, casts on the way in), but a full buffer is sent instead
of written: one step per bucket is an all-gather of every rank's run list
(file, offset, length per run, plus done / failed flags; never a tensor) and
one ``all_to_all_single`` that moves each rank's packed bytes to the writer,
which ``pwrite``s them. The run lists reach every rank, not only the writer,
and they are not always small: a shard that is not contiguous in the file
(a shard of dim 1, as column-wise TP makes) is one run per row. A rank that has sent
everything keeps taking part with empty buckets until every rank is done, so
every rank runs the same number of collectives.

Memory: each rank's packer holds ``bucket_bytes / world``; the writer holds its
own share plus the step's receive buffer (every rank's share, about
``bucket_bytes``), so about ``bucket_bytes + bucket_bytes / world`` (and a host
copy of the receive buffer when the wire buffers are on a GPU).

Failures are agreed per bucket: a rank whose packing (or the writer, whose
``pwrite``) fails says so in the next step's all-gather, every rank stops
there, the failing rank raises its own exception and the others a
``RemoteRankError`` naming it; ``Output.finish`` then agrees on the one
``SaveError`` every rank raises.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import RemoteRankError
from ..transport.arrival import wait_work
from ..transport.collectives import all_gather_object, solo
from .layout import Layout
from .plan import SavePlan
from .write import _ALIGN, WriteStats, _Packer, _pwrite_all, pack_all, write_owners


class _Stop(Exception):
    """Another rank failed: stop at this step (every rank stops at the same one)."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(rank, reason)
        self.rank = rank
        self.reason = reason


class _Exchange:
    """The per-bucket steps between the packing ranks and the writer (group rank 0)."""

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, fds: dict[str, int], stats: WriteStats
    ) -> None:
        self.group = group
        self.device = device
        self.fds = fds
        self.stats = stats
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1
        self.global_rank = dist.get_rank() if group is not None else 0
        self.steps = 0

    def step(
        self,
        data: torch.Tensor | None,
        runs: list[tuple[str, int, int, int]],
        done: bool,
        failed: BaseException | None = None,
    ) -> bool:
        """One bucket: agree, move, write. Returns True when every rank is done.

        Raises:
            _Stop: some rank reported a failure in this step (on every rank, the failing one included).
            OSError: the writer's ``pwrite`` failed (raised after the collectives of this step).
        """
        self.steps += 1
        nbytes = 0 if data is None else data.numel()
        if failed is not None:
            meta: Any = ("failed", self.global_rank, f"{type(failed).__name__}: {failed}")
        else:
            meta = ("ok", nbytes, list(runs) if self.rank == 0 or nbytes else [], done)
        gathered = all_gather_object(meta, self.group, self.device)
        bad = [g for g in gathered if g[0] == "failed"]
        if bad:
            raise _Stop(bad[0][1], bad[0][2])
        sizes = [g[1] for g in gathered]
        recv = self._move(data, sizes)
        if self.rank == 0 and recv is not None:
            view = recv.numpy().data
            base = 0
            for _tag, n, their_runs, _done in gathered:
                for file, off, at, length in their_runs:
                    _pwrite_all(self.fds[file], view[base + at : base + at + length], off)
                    self.stats.wrote(length)
                base += n
        return all(g[3] for g in gathered)

    def _move(self, data: torch.Tensor | None, sizes: list[int]) -> torch.Tensor | None:
        """Every rank's bytes of this step to the writer; its receive buffer (on the CPU), else None."""
        empty = torch.empty(0, dtype=torch.uint8, device=self.device)
        send = empty if data is None or data.numel() == 0 else data.to(self.device)
        total = sum(sizes)
        if solo(self.group):
            return send.cpu() if self.rank == 0 else None
        if total == 0:
            return torch.empty(0, dtype=torch.uint8) if self.rank == 0 else None
        recv = torch.empty(total if self.rank == 0 else 0, dtype=torch.uint8, device=self.device)
        out_splits = sizes if self.rank == 0 else [0] * self.world
        in_splits = [0] * self.world
        in_splits[0] = send.numel()
        wait_work(
            dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group, async_op=True),
            self.device,
        )
        if self.rank == 0:
            self.stats.peak_buffer_bytes = max(self.stats.peak_buffer_bytes, total)
            return recv.cpu()
        return None


class _SendPacker(_Packer):
    """The owners packer, whose full buffer goes to the writer instead of to ``pwrite``."""

    def __init__(self, bucket_bytes: int, exchange: _Exchange, stats: WriteStats) -> None:
        super().__init__(bucket_bytes, {}, stats)
        self.exchange = exchange

    def flush(self) -> None:
        end = max((at + n for _f, _o, at, n in self.runs), default=0)
        self.exchange.step(self.buf[:end], self.runs, done=False)
        self.runs.clear()
        self.pos = 0


def write_src(
    plan: SavePlan,
    layout: Layout,
    fds: dict[str, int],
    bucket_bytes: int,
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
    bar: Any = None,
) -> WriteStats:
    """Collective: every rank's pieces written by group rank 0.

    Args:
        plan: this rank's pieces (``plan_save``).
        layout: the output layout.
        fds: on group rank 0, output file name -> a descriptor open for writing (others: ``{}``).
        bucket_bytes: the writer's receive buffer per step; each rank packs ``bucket_bytes / world``.
        group: the save's process group (None: one process, which writes everything itself).
        device: where the wire buffers live (default CPU: gloo; pass the CUDA device for NCCL).

    Returns:
        WriteStats; on the writer the bytes and ``pwrite`` calls of every rank's pieces.

    Raises:
        RemoteRankError: on the ranks that did not fail, naming the one that did.
        (the failing rank raises its own exception)

    Example:
        >>> fds = {f.name: out.open(f.name) for f in layout.files} if rank == 0 else {}
        >>> stats = write_src(plan, layout, fds, 64 << 20, group)
    """
    world = dist.get_world_size(group) if group is not None else 1
    if solo(group):
        return write_owners(plan, layout, fds, bucket_bytes, bar)
    stats = WriteStats(bar=bar)
    exchange = _Exchange(group, device or torch.device("cpu"), fds, stats)
    share = max(_ALIGN, bucket_bytes // world)
    try:
        try:
            if plan.pieces:
                # The owners loop, with a packer that sends: the pieces, their cuts and casts are the same.
                pack_all(plan, layout, _SendPacker(share, exchange, stats))
            while not exchange.step(None, [], done=True):
                pass
        except _Stop:
            raise
        except BaseException as exc:
            # This rank failed (packing, or the writer's pwrite): say so in the next step, which
            # stops every rank there; then raise its own exception.
            try:
                exchange.step(None, [], done=True, failed=exc)
            except _Stop:
                pass
            raise
    except _Stop as stop:
        raise RemoteRankError(
            f"rank {stop.rank} failed while saving: {stop.reason}", rank=stop.rank
        ) from None
    return stats
