"""The ``src`` writer: one rank writes the files, every rank sends it its pieces.

For output directories that only the writing rank sees (node-local disks).
Each rank packs its pieces exactly as the ``owners`` writer does (same
packer, file order, casts on the way in), but a full buffer is sent instead
of written. One step per bucket:

1. an all-gather of five integers per rank (failed, data bytes, run-list bytes, done, whether
   the run list fits behind the data in the rank's buffer);
2. the packed bytes to the writer (one ``all_to_all_single`` in which only group rank 0
   receives), started without waiting, each rank's run list behind its bytes: the run lists
   reach the writer alone. Each run is (file, offset, buffer offset, length, count, stride), so
   rows of equal length at a constant file stride (a shard of dim 1, as column-wise TP makes,
   one run per row) travel as one tuple. In a step where some rank's list does not fit its
   buffer's spare room, the lists go first in an ``all_to_all_single`` of their own.

The transport and the ``pwrite``s overlap: the writer hands a received bucket to a
thread that writes it while the next bucket is packed and received (two receive buffers,
used in turn), and every sender packs the next bucket into its second buffer while the
previous one is still on the wire. A rank that has sent everything keeps taking part with
empty buckets until every rank is done, so every rank runs the same number of collectives;
the writer says it is done only once every write it was handed has finished.

Memory: each rank's packer holds two buffers of ``bucket_bytes / (2 * world)`` (an eighth of
each is room for the run list); the writer
also holds two receive buffers of every rank's share (about ``bucket_bytes / 2`` each), so
about ``bucket_bytes + bucket_bytes / world`` (and host copies of the receive buffers when the
wire buffers are on a GPU).

Failures are agreed per bucket: a rank whose packing (or the writer, whose
``pwrite``) fails says so in the next step's all-gather, every rank stops
there, the failing rank raises its own exception and the others a
``RemoteRankError`` naming it; ``Output.finish`` then agrees on the one
``SaveError`` every rank raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import RemoteRankError
from ..transport.arrival import wait_work
from ..transport.collectives import all_gather_object, solo
from .layout import Layout
from .plan import SavePlan
from .write import _ALIGN, WriteStats, _Packer, _pwrite_all, pack_all, write_owners

_RUN_FIELDS = 6  # file index, file offset, buffer offset, length, count, file stride
_FLAGS = 5  # failed, data bytes, run-list bytes, done, run list behind the data


class _Stop(Exception):
    """A rank failed: stop at this step (every rank stops at the same one).

    ``own`` is the failing rank's own exception, on that rank (None elsewhere)."""

    def __init__(self, rank: int, reason: str, own: BaseException | None = None) -> None:
        super().__init__(rank, reason)
        self.rank = rank
        self.reason = reason
        self.own = own


def encode_runs(runs: list[tuple[str, int, int, int]], files: dict[str, int]) -> np.ndarray:
    """A packer's runs as an int64 [n, 6] array; consecutive runs of one length, adjacent in
    the buffer and at a constant file stride, merged into one row.

    Args:
        runs: (file, file offset, buffer offset, length) in buffer order.
        files: file name -> index.

    Returns:
        Rows of (file index, file offset, buffer offset, length, count, file stride).

    Example:
        >>> encode_runs([("f", 0, 0, 8), ("f", 32, 8, 8), ("f", 64, 16, 8)], {"f": 0}).tolist()
        [[0, 0, 0, 8, 3, 32]]
    """
    rows: list[list[int]] = []
    for file, off, at, n in runs:
        f = files[file]
        if rows:
            last = rows[-1]
            lf, loff, lat, ln, count, stride = last
            if lf == f and ln == n and lat + count * n == at:
                if count == 1 and off > loff:
                    last[4], last[5] = 2, off - loff
                    continue
                if count > 1 and loff + count * stride == off:
                    last[4] += 1
                    continue
        rows.append([f, off, at, n, 1, 0])
    return np.asarray(rows, dtype=np.int64).reshape(-1, _RUN_FIELDS)


@dataclass
class _Bucket:
    """One step's bytes on their way to the writer: the data collective and, on the writer,
    its receive buffer, each rank's (start in it, run list)."""

    work: Any
    recv: torch.Tensor | None
    segments: list[_Segment]
    slot: int = 0


@dataclass(frozen=True)
class _Segment:
    """One rank's part of a received bucket: where it starts, and its run list (or where in it
    the list is, when it travelled behind the bytes)."""

    base: int
    runs: np.ndarray | None
    runs_at: int = 0
    runs_bytes: int = 0


class _Exchange:
    """The per-bucket steps between the packing ranks and the writer (group rank 0)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        fds: dict[str, int],
        files: list[str],
        stats: WriteStats,
        share: int = 0,
    ) -> None:
        self.group = group
        self.device = device
        self.fds = fds
        self.files = files
        self.index = {name: i for i, name in enumerate(files)}
        self.stats = stats
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1
        self.global_rank = dist.get_rank() if group is not None else 0
        self.capacity = share * self.world  # a receive buffer: every rank's share
        self.steps = 0
        self.flying: _Bucket | None = None
        # The writer: one thread writing received buckets in order, two receive buffers in turn.
        self.pool = (
            ThreadPoolExecutor(1, thread_name_prefix="streamload-src-write") if self.rank == 0 else None
        )
        self.slots: list[torch.Tensor | None] = [None, None]
        self.writes: list[Future[None] | None] = [None, None]

    def step(
        self,
        data: torch.Tensor | None,
        runs: list[tuple[str, int, int, int]],
        done: bool,
        failed: BaseException | None = None,
        room: torch.Tensor | None = None,
    ) -> bool:
        """One bucket: the previous one landed, agree, move this one. Returns True when every
        rank is done (and the writer wrote everything). ``data`` is the start of ``room`` (the
        packer's whole buffer), whose rest may carry the run list.

        Raises:
            _Stop: some rank reported a failure in this step (on every rank, the failing one included).
        """
        self.steps += 1
        if failed is None:
            failed = self._land(drain=done)
        else:
            self._land(drain=True)
        header = encode_runs(runs, self.index) if data is not None and data.numel() else None
        nbytes = 0 if header is None or data is None else data.numel()
        hb = 0 if header is None else header.nbytes
        at = -(-nbytes // 8) * 8  # the run list's place behind the data (int64-aligned)
        inline = hb == 0 or (room is not None and at + hb <= room.numel())
        flags = [int(failed is not None), nbytes, hb, int(done), int(inline)]
        gathered = self._all_gather(flags)
        bad = [r for r, g in enumerate(gathered) if g[0]]
        if bad:
            reason = None if failed is None else f"{type(failed).__name__}: {failed}"
            reasons = all_gather_object((self.global_rank, reason), self.group, self.device)
            first = reasons[bad[0]]
            raise _Stop(first[0], first[1], own=failed)
        if all(g[4] for g in gathered):  # every run list rides behind its rank's bytes
            if header is not None and room is not None:
                room[at : at + hb].copy_(torch.from_numpy(header.reshape(-1).view(np.uint8)))
            sizes = [-(-g[1] // 8) * 8 + g[2] if g[2] else g[1] for g in gathered]
            spans = [(-(-g[1] // 8) * 8, g[2]) for g in gathered]
            send = room[: at + hb] if header is not None and room is not None else None
            if sum(sizes):
                self.flying = self._send(send, sizes, [None] * self.world, spans)
        else:
            sizes = [g[1] for g in gathered]
            headers = self._headers(header, [g[2] for g in gathered])
            if sum(sizes):
                self.flying = self._send(data if nbytes else None, sizes, headers, [(0, 0)] * self.world)
        return all(g[3] for g in gathered)

    def _all_gather(self, flags: list[int]) -> list[list[int]]:
        mine = torch.tensor(flags, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        wait_work(dist.all_gather(out, mine, group=self.group, async_op=True), self.device)
        return [t.tolist() for t in out]

    def _headers(self, header: np.ndarray | None, sizes: list[int]) -> list[np.ndarray]:
        """Every rank's run list, on the writer (elsewhere, empty lists)."""
        empty = np.zeros((0, _RUN_FIELDS), dtype=np.int64)
        if not sum(sizes):
            return [empty] * self.world
        send = torch.empty(0, dtype=torch.uint8)
        if header is not None:
            send = torch.from_numpy(header.reshape(-1).view(np.uint8).copy())
        send = send.to(self.device)
        recv = torch.empty(sum(sizes) if self.rank == 0 else 0, dtype=torch.uint8, device=self.device)
        in_splits = [0] * self.world
        in_splits[0] = send.numel()
        out_splits = sizes if self.rank == 0 else [0] * self.world
        wait_work(
            dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group, async_op=True),
            self.device,
        )
        if self.rank != 0:
            return [empty] * self.world
        flat = recv.cpu().numpy()
        out, at = [], 0
        for n in sizes:
            out.append(flat[at : at + n].view(np.int64).reshape(-1, _RUN_FIELDS))
            at += n
        return out

    def _send(
        self,
        data: torch.Tensor | None,
        sizes: list[int],
        headers: Sequence[np.ndarray | None],
        spans: list[tuple[int, int]],
    ) -> _Bucket:
        """Starts moving this step's bytes to the writer (rank 0: into the free receive buffer);
        each rank's run list given (``headers``) or at ``spans`` (offset, bytes) in its bytes."""
        send = torch.empty(0, dtype=torch.uint8, device=self.device) if data is None else data.to(self.device)
        total = sum(sizes)
        recv = torch.empty(0, dtype=torch.uint8, device=self.device)
        segments: list[_Segment] = []
        if self.rank == 0:
            recv = self._slot(total)
            base = 0
            for n, runs, (runs_at, runs_bytes) in zip(sizes, headers, spans, strict=True):
                segments.append(_Segment(base, runs, runs_at, runs_bytes))
                base += n
        in_splits = [0] * self.world
        in_splits[0] = send.numel()
        out_splits = sizes if self.rank == 0 else [0] * self.world
        work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group, async_op=True)
        # ``send`` is the packer's buffer on the CPU: the packer fills its other one meanwhile.
        return _Bucket(work, recv if self.rank == 0 else None, segments, self.steps % 2)

    def _slot(self, total: int) -> torch.Tensor:
        """The receive buffer of this step: the one whose bytes were written, reused."""
        k = self.steps % 2
        pending = self.writes[k]
        if pending is not None:  # not reached: _land waited for this slot's writes before the all-gather
            pending.result()
            self.writes[k] = None
        buf = self.slots[k]
        if buf is None or buf.numel() < total:
            # Full size at once: buffers grown step by step would leave freed ones in the heap.
            buf = torch.empty(max(total, self.capacity), dtype=torch.uint8, device=self.device)
            self.slots[k] = buf
        self.stats.peak_buffer_bytes = max(
            self.stats.peak_buffer_bytes, sum(s.numel() for s in self.slots if s is not None)
        )
        return buf[:total]

    def _land(self, drain: bool) -> BaseException | None:
        """Waits for the bucket on the wire; on the writer, hands it to the write thread (and,
        with ``drain``, waits for every write). Returns the writer's failure, if any."""
        bucket, self.flying = self.flying, None
        if bucket is not None:
            wait_work(bucket.work, self.device)
            if self.rank == 0 and bucket.recv is not None and self.pool is not None:
                host = bucket.recv.cpu()
                self.writes[bucket.slot] = self.pool.submit(self._write, host, bucket.segments)
        if self.rank != 0:
            return None
        reuse = self.steps % 2  # the receive slot this step fills: its writes must have ended
        for k, pending in enumerate(self.writes):
            # Waited for here, before the step's all-gather, so a write that fails late is this
            # step's reported failure on every rank (never a raise between two collectives).
            if pending is None or not (drain or k == reuse or pending.done()):
                continue
            self.writes[k] = None
            exc = pending.exception()
            if exc is not None:
                return exc
        return None

    def _write(self, recv: torch.Tensor, segments: list[_Segment]) -> None:
        """The write thread: every rank's runs of one bucket."""
        flat = recv.numpy()
        view = memoryview(flat)  # type: ignore[arg-type]
        for seg in segments:
            base, runs = seg.base, seg.runs
            if runs is None:
                start = base + seg.runs_at
                runs = flat[start : start + seg.runs_bytes].view(np.int64).reshape(-1, _RUN_FIELDS)
            for f, off, at, n, count, stride in runs.tolist():
                fd = self.fds[self.files[f]]
                for j in range(count):
                    start = base + at + j * n
                    _pwrite_all(fd, view[start : start + n], off + j * stride)
                self.stats.wrote(n * count, count)

    def close(self) -> None:
        """Waits for the writes still running (their errors were reported, or the save failed)."""
        if self.flying is not None:
            try:
                wait_work(self.flying.work, self.device)
            except Exception:  # noqa: BLE001 - the save already failed; the peers say why
                pass
            self.flying = None
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class _SendPacker(_Packer):
    """The owners packer, whose full buffer goes to the writer instead of to ``pwrite``; two
    buffers, so one is packed while the other is on the wire."""

    def __init__(self, share: int, room: int, exchange: _Exchange, stats: WriteStats) -> None:
        super().__init__(share + room, {}, stats)
        self.exchange = exchange
        self.share = share
        self.full, self.spare = self.buf, torch.empty(share + room, dtype=torch.uint8)
        self.buf = self.full[:share]  # packed up to the share; the rest is room for the run list
        self.stats.peak_buffer_bytes = max(self.stats.peak_buffer_bytes, 2 * (share + room))

    def flush(self) -> None:
        end = max((at + n for _f, _o, at, n in self.runs), default=0)
        self.exchange.step(self.buf[:end], self.runs, done=False, room=self.full)
        self.runs.clear()
        self.pos = 0
        # The buffer just sent is on the wire until the next step lands it: pack into the other.
        self.full, self.spare = self.spare, self.full
        self.buf = self.full[: self.share]


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
        bucket_bytes: the writer's two receive buffers together; each rank packs
            ``bucket_bytes / (2 * world)`` per step.
        group: the save's process group (None: one process, which writes everything itself).
        device: where the wire buffers live (default CPU: gloo; pass the CUDA device for NCCL).
        bar: a progress bar the writer's writes advance, or None.

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
    files = [f.name for f in layout.files]
    per_rank = max(2 * _ALIGN, bucket_bytes // (2 * world) // _ALIGN * _ALIGN)
    room = max(_ALIGN, per_rank // 8 // _ALIGN * _ALIGN)  # the run list's, behind the data
    share = per_rank - room
    exchange = _Exchange(group, device or torch.device("cpu"), fds, files, stats, per_rank)
    try:
        try:
            if plan.pieces:
                # The owners loop, with a packer that sends: the pieces, their cuts and casts are the same.
                pack_all(plan, layout, _SendPacker(share, room, exchange, stats))
            while not exchange.step(None, [], done=True):
                pass
        except _Stop:
            raise
        except BaseException as exc:
            # This rank failed (packing): say so in the next step, which stops every rank
            # there; then raise its own exception.
            try:
                exchange.step(None, [], done=True, failed=exc)
            except _Stop:
                pass
            raise
        finally:
            exchange.close()
    except _Stop as stop:
        if stop.own is not None:
            raise stop.own from None
        raise RemoteRankError(
            f"rank {stop.rank} failed while saving: {stop.reason}", rank=stop.rank
        ) from None
    return stats
