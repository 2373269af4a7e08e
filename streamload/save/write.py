"""Writers: the bytes of a save plan into the output files.

``owners`` (every rank writes its own pieces; the files must be one file
system every rank sees): pieces are packed in file order into one
bucket-sized host buffer, cast on the way in (``copy_`` is torch's own
conversion, as ``.to()``), and written with ``os.pwrite`` in runs, adjacent
runs coalesced into one call. A piece larger than the bucket is cut into
bucket-sized boxes, so no rank ever holds more than the bucket beyond its
own shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..io.copy_ops import ITEMSIZE
from ..plan.buckets import split_box
from ..plan.regions import Box
from ..report import progress_enabled
from .layout import HubTensor, Layout
from .plan import Piece, SavePlan, local_of
from .stage import device_reader

_ALIGN = 16


@dataclass
class WriteStats:
    """What one rank's writer did.

    Attributes:
        bytes_written: tensor bytes this rank wrote (headers excluded).
        writes: ``pwrite`` calls made (after coalescing).
        peak_buffer_bytes: the largest host buffer this writer held at once.
        bar: the progress bar the writes advance (rank 0 only; None: no bar).
    """

    bytes_written: int = 0
    writes: int = 0
    peak_buffer_bytes: int = 0
    bar: Any = field(default=None, repr=False)

    def wrote(self, nbytes: int, calls: int = 1) -> None:
        """Counts ``calls`` writes of ``nbytes`` in all, and advances the bar."""
        self.writes += calls
        self.bytes_written += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)


def progress_bar(total: int, enabled: bool | None, desc: str) -> Any:
    """A tqdm bar of bytes written (its rate is the write speed, in GB/s once that large), or None
    when ``enabled`` says no: as the loads' bar, off unless asked (``progress=True`` or
    ``STREAMLOAD_PROGRESS=1``) or stderr is a TTY, so off under CI.

    Example:
        >>> bar = progress_bar(layout.total_size, None, "streamload save")
    """
    if not progress_enabled(enabled):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset}")
        data, offset = data[n:], offset + n


def file_runs(h: HubTensor, box: Box) -> list[tuple[int, int]]:
    """The (absolute file offset, length) runs of ``box`` of hub tensor ``h``, in row-major order.

    Args:
        h: the hub tensor (its file offset, dtype and shape).
        box: [start, stop) per hub dim.

    Returns:
        One run per outer index of the box; a single run when the box is a contiguous span.

    Example:
        >>> file_runs(HubTensor("w", "F32", (4, 3), "f", 64), ((1, 3), (0, 3)))
        [(76, 24)]
    """
    item = ITEMSIZE[h.dtype]
    shape = h.shape
    n = len(shape)
    # Dims from ``k`` inward are whole in the box: each outer index is one contiguous run.
    k = n
    while k > 0 and box[k - 1] == (0, shape[k - 1]):
        k -= 1
    strides = [item] * n
    for d in range(n - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    if k == 0:
        return [(h.offset, item * _numel(shape))]
    inner = strides[k - 1] * (box[k - 1][1] - box[k - 1][0])
    runs: list[tuple[int, int]] = []

    def rec(d: int, off: int) -> None:
        if d == k - 1:
            runs.append((off + box[d][0] * strides[d], inner))
            return
        for i in range(box[d][0], box[d][1]):
            rec(d + 1, off + i * strides[d])

    rec(0, h.offset)
    return runs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Packer:
    """One host buffer; pieces go in, coalesced runs go out with ``pwrite``."""

    def __init__(self, bucket_bytes: int, fds: dict[str, int], stats: WriteStats) -> None:
        self.buf = torch.empty(bucket_bytes, dtype=torch.uint8)
        self.view = memoryview(self.buf.numpy())  # type: ignore[arg-type]
        self.fds = fds
        self.stats = stats
        self.stats.peak_buffer_bytes = max(self.stats.peak_buffer_bytes, bucket_bytes)
        self.pos = 0
        self.runs: list[tuple[str, int, int, int]] = []  # (file, file offset, buffer offset, length)

    def add(self, h: HubTensor, box: Box, src: torch.Tensor) -> None:
        """Packs ``src`` (hub-order view of ``box`` of ``h``) and queues its file runs."""
        nbytes = src.numel() * ITEMSIZE[h.dtype]
        start = -(-self.pos // _ALIGN) * _ALIGN
        if start + nbytes > self.buf.numel():
            self.flush()
            start = 0
        dst = self.buf[start : start + nbytes].view(h.torch_dtype).view(src.shape)
        dst.copy_(src)
        self.pos = start + nbytes
        at = start
        for off, n in file_runs(h, box):
            last = self.runs[-1] if self.runs else None
            if (
                last is not None
                and last[0] == h.file
                and last[1] + last[3] == off
                and last[2] + last[3] == at
            ):
                self.runs[-1] = (last[0], last[1], last[2], last[3] + n)
            else:
                self.runs.append((h.file, off, at, n))
            at += n

    def flush(self) -> None:
        for file, off, at, n in self.runs:
            _pwrite_all(self.fds[file], self.view[at : at + n], off)
        self.stats.wrote(sum(n for _f, _o, _a, n in self.runs), len(self.runs))
        self.runs.clear()
        self.pos = 0


def write_owners(
    plan: SavePlan, layout: Layout, fds: dict[str, int], bucket_bytes: int, bar: Any = None
) -> WriteStats:
    """Writes this rank's pieces straight into the output files.

    Args:
        plan: this rank's pieces (``plan_save``).
        layout: the output layout (offsets, dtypes).
        fds: output file name -> a descriptor open for writing.
        bucket_bytes: the host buffer's size; pieces larger than it are cut.
        bar: a progress bar the writes advance (``progress_bar``), or None.

    Returns:
        WriteStats (bytes, pwrite calls, peak buffer bytes).

    Example:
        >>> stats = write_owners(plan, layout, {f.name: out.open(f.name) for f in layout.files}, 64 << 20)
    """
    stats = WriteStats(bar=bar)
    if not plan.pieces:
        return stats
    largest = max(_piece_bytes(p, layout) for p in plan.pieces)
    pack_all(plan, layout, _Packer(max(_ALIGN, min(bucket_bytes, largest)), fds, stats))
    return stats


def _piece_bytes(p: Piece, layout: Layout) -> int:
    return _numel(p.shape) * ITEMSIZE[layout.tensors[p.key].dtype]


def write_headers(layout: Layout, fds: dict[str, int]) -> int:
    """Writes every file's safetensors header at offset 0 (one rank does this).

    Args:
        layout: the output layout (its files' header bytes).
        fds: output file name -> a descriptor open for writing.

    Returns:
        The header bytes written.

    Example:
        >>> write_headers(layout, {f.name: out.open(f.name) for f in layout.files})
        1296
    """
    n = 0
    for f in layout.files:
        _pwrite_all(fds[f.name], memoryview(f.header), 0)
        n += len(f.header)
    return n


def pack_all(plan: SavePlan, layout: Layout, packer: _Packer) -> None:
    """Every piece of ``plan`` through ``packer`` (cut to its buffer), then a last flush: the
    owners writer's loop, so both writers cut, cast and quantize identically. Pieces of device
    shards are read into page-locked host slots first (``save.stage``): the cast and the fp8
    quantization run on the host."""
    limit = packer.buf.numel()
    fp8 = plan.fp8
    parts: list[tuple[tuple[HubTensor, Box, Piece], torch.Tensor]] = []
    for piece in plan.pieces:
        h = layout.tensors[piece.key]
        src = piece.view(local_of(plan.tensors[piece.target]))
        box = tuple((s, s + n) for s, n in zip(piece.src_start, piece.hub_shape(), strict=True))
        itemsize = ITEMSIZE[h.dtype] if fp8 is None else fp8.itemsize(piece, ITEMSIZE[h.dtype])
        for sub in split_box(box, itemsize, limit):
            part = src
            for d, ((lo, hi), (b0, _)) in enumerate(zip(sub, box, strict=True)):
                part = part.narrow(d, lo - b0, hi - lo)
            parts.append(((h, sub, piece), part))
    with device_reader([p for _k, p in parts]) as reader:
        for (h, sub, piece), part in parts if reader is None else reader.stream(parts):
            packer.add(h, sub, part if fp8 is None else fp8.quantize(piece, sub, part))
    packer.flush()
