"""Pack (reader only): gather every rank's segments of a bucket straight from
the mapped files into a staging slot, in one native call per bucket. Fusion,
slicing and narrowing casts happen here. The reader's own segments (on CPU)
go straight from the files into its shards, with the full cast."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..io.copy_ops import ITEMSIZE, ST_DTYPES, OpBatch, contiguous_strides
from ..io.sources import Source
from ..plan.buckets import Bucket, Plan, Segment
from ..plan.quant import QuantTensor, dequant_region
from ..plan.regions import Box, SourcePiece, SourceRegion, regions_for_box


class StagingRing:
    """``slots`` reusable byte buffers of ``slot_bytes`` each.

    Attributes:
        peak_bytes: bytes the ring's buffers hold together (allocated once).
    """

    def __init__(self, slots: int, slot_bytes: int, pin: bool = False) -> None:
        self.slot_bytes = slot_bytes
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self.peak_bytes = slots * slot_bytes

    def __getitem__(self, k: int) -> torch.Tensor:
        return self.slots[k % len(self.slots)]


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element."""
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def add_box_ops(
    batch: OpBatch,
    source: Source,
    pieces: Sequence[SourcePiece],
    box: Box,
    dst: torch.Tensor,
    dst_dtype: str,
    dst_strides: list[int],
    first: int,
    dst_nbytes: int | None = None,
    virtual: Any = None,
    keep: list[torch.Tensor] | None = None,
    quant: Mapping[str, QuantTensor] | None = None,
) -> None:
    """Adds the copy ops that fill ``box`` of a destination tiled by ``pieces``.

    Args:
        batch: where the ops go.
        source: the checkpoint (or state dict) the pieces read from.
        pieces: the destination's region algebra.
        box: the destination box to fill, global coordinates.
        dst: the tensor written; ``first`` is the element offset of the box's
            first element from ``dst.data_ptr()``, ``dst_strides`` its strides.
        virtual: FallbackSources for keys built by transformers' own ops;
            their tensors are appended to ``keep`` until the batch has run.
        quant: logical keys the checkpoint stores quantized: their regions
            become dequantizing ops reading only what the region needs.
    """
    for reg in regions_for_box(pieces, box):
        if quant is not None and reg.key in quant:
            dst_offset = first + sum(b * st for b, st in zip(reg.box_start, dst_strides, strict=True))
            _add_dequant(
                batch, source, quant[reg.key], reg, dst, dst_dtype, dst_strides, dst_offset, dst_nbytes
            )
            continue
        if virtual is not None and reg.key in virtual:
            t = virtual.tensor(reg.key)
            if keep is not None:
                keep.append(t)
            file, src, nbytes, dtype = -1, t.data_ptr(), t.numel() * t.element_size(), ST_DTYPES[t.dtype]
            shape: tuple[int, ...] = tuple(t.shape)
        else:
            info = source.info(reg.key)
            file, src, nbytes, dtype, shape = info.file_index, info.begin, info.nbytes, info.dtype, info.shape
        full = contiguous_strides(shape)
        batch.add(
            file=file,
            src=src,
            src_nbytes=nbytes,
            src_dtype=dtype,
            dst=dst,
            dst_dtype=dst_dtype,
            dst_nbytes=dst_nbytes,
            shape=reg.shape,
            src_strides=[0 if d is None else full[d] for d in reg.dims],
            dst_strides=dst_strides,
            src_offset=sum(s * st for s, st in zip(reg.src_start, full, strict=True)),
            dst_offset=first + sum(b * st for b, st in zip(reg.box_start, dst_strides, strict=True)),
        )


def _add_dequant(
    batch: OpBatch,
    source: Source,
    q: QuantTensor,
    reg: SourceRegion,
    dst: torch.Tensor,
    dst_dtype: str,
    dst_strides: list[int],
    dst_offset: int,
    dst_nbytes: int | None,
) -> None:
    w, s = source.info(q.weight), source.info(q.scale)
    geo = dequant_region(q, reg, dst_strides)
    batch.add_dequant(
        kind=q.kind,
        weight=(w.file_index, w.begin, w.nbytes, w.dtype),
        scale=(s.file_index, s.begin, s.nbytes, s.dtype),
        dst=dst,
        dst_dtype=dst_dtype,
        dims=q.dims,
        block=q.block,
        box=geo.box,
        dst_offset=dst_offset,
        dst_strides=geo.strides,
        dst_nbytes=dst_nbytes,
    )


def _region_extent(info: Any, reg: SourceRegion) -> tuple[int, int]:
    """The [start, end) bytes of ``reg`` in its file's data section (``info``: its tensor's)."""
    isz = ITEMSIZE[info.dtype]
    full = contiguous_strides(info.shape)
    first = sum(s * st for s, st in zip(reg.src_start, full, strict=True))
    last = first + sum((n - 1) * full[d] for n, d in zip(reg.shape, reg.dims, strict=True) if d is not None)
    return info.begin + first * isz, info.begin + (last + 1) * isz


class Packer:
    """Fills staging slots (and the reader's own shards) from a checkpoint.

    Args:
        ckpt: the opened checkpoint.
        plan: the plan every rank computed.
        locals_: this rank's local shard per target, for direct segments.
        skip: targets whose direct segments need no copy (mapped shards).
    """

    def __init__(
        self,
        ckpt: Source,
        plan: Plan,
        locals_: Sequence[torch.Tensor] | None = None,
        virtual: Any = None,
        skip: frozenset[int] = frozenset(),
        quant: Mapping[str, QuantTensor] | None = None,
    ) -> None:
        self.ckpt = ckpt
        self.quant = quant
        self.skip = skip
        self.plan = plan
        self.locals = list(locals_ or [])
        self.virtual = virtual  # FallbackSources: tensors built on the reader by transformers' ops
        self.bytes_read = 0
        self._keep: list[torch.Tensor] = []  # virtual tensors referenced by the pending batch
        # The next bucket's ops, built early for read-ahead: (bucket, slot address, slot bytes, only, ops).
        self._next: tuple[Bucket, int, int, int | None, OpBatch] | None = None
        self._index: dict[int, int] | None = None  # id(bucket) -> its index in the plan
        # Set by the pipeline before ``pack``: the next bucket and its slot, for read-ahead.
        self.upcoming: tuple[Bucket, torch.Tensor] | None = None

    def _add_segment(
        self,
        batch: OpBatch,
        seg: Segment,
        dst: torch.Tensor,
        dst_dtype: str,
        dst_strides: list[int],
        first: int,
        dst_nbytes: int | None = None,
    ) -> None:
        add_box_ops(
            batch,
            self.ckpt,
            self.plan.targets[seg.target].pieces,
            seg.box,
            dst,
            dst_dtype,
            dst_strides,
            first,
            dst_nbytes,
            self.virtual,
            self._keep,
            self.quant,
        )

    @property
    def lands_ahead(self) -> bool:
        """True when the next bucket's reads may land in its slot before it is packed: the
        engine reads announced batches straight into their destinations (cold, buffered:
        ``ColdEngine.lands_ahead``) and this load's batches are announced (see ``_announce``).
        ``upcoming`` must then name a slot that nothing reads or writes until that bucket
        is packed, and ``drain`` must run before any slot or shard is given up."""
        return bool(getattr(self.ckpt.engine, "lands_ahead", False)) and self._announces

    @property
    def _announces(self) -> bool:
        """This load's batches may be announced: none reads quantized sources (dequantized on
        the fly) or tensors built by transformers' ops (those hold one group at a time)."""
        fallbacks = getattr(getattr(self.virtual, "conversion", None), "fallbacks", None)
        return not self.quant and not fallbacks

    def drain(self) -> None:
        """Waits for every read in flight and drops the announced ones (reads of the next
        bucket may be landing in its slot or in the shards): before a pipeline that stopped
        early, after a failure anywhere, gives up its memory."""
        self._next = None
        drain = getattr(self.ckpt.engine, "drain", None)
        if drain is not None:
            drain()

    def check_source(self) -> None:
        """Raises CheckpointFileError if a file shrank since it was opened (a
        mapped page past the new end would otherwise fault)."""
        check = getattr(self.ckpt, "check_unchanged", None)
        if check is not None:
            check()

    def _build(self, bucket: Bucket, slot: torch.Tensor, only: int | None) -> OpBatch:
        """The copy ops that pack ``bucket`` into ``slot`` (see ``pack``)."""
        batch = OpBatch()
        for rank, segs in enumerate(bucket.segments):
            if only is not None and rank != only:
                continue
            if rank == bucket.direct_rank:
                for seg in segs:
                    if seg.target in self.skip:
                        continue
                    local = self.locals[seg.target]
                    strides = list(local.stride())
                    first = sum(s * st for s, st in zip(seg.local_start, strides, strict=True))
                    self._add_segment(
                        batch, seg, local, ST_DTYPES[local.dtype], strides, first, _extent_bytes(local)
                    )
                continue
            base = bucket.wire_base(rank) if only is None else 0
            for seg in segs:
                isz = ITEMSIZE[seg.wire_dtype]
                seg_strides = contiguous_strides([hi - lo for lo, hi in seg.box])
                self._add_segment(batch, seg, slot, seg.wire_dtype, seg_strides, (base + seg.offset) // isz)
        return batch

    def source_spans(self, only: int | None = None) -> dict[int, list[tuple[int, int]]]:
        """Every span of the files this load's buckets read (``only``: that rank's segments),
        as (start, end) in each file's data section, by file index: the byte extent of each
        source region (a column slice spans its rows). Quantized and built tensors are left out."""
        spans: dict[int, list[tuple[int, int]]] = {}
        virtual = self.virtual if self.virtual is not None else ()
        for bucket in self.plan.buckets:
            for rank, segs in enumerate(bucket.segments):
                if only is not None and rank != only:
                    continue
                for seg in segs:
                    for reg in regions_for_box(self.plan.targets[seg.target].pieces, seg.box):
                        if (self.quant is not None and reg.key in self.quant) or reg.key in virtual:
                            continue
                        info = self.ckpt.info(reg.key)
                        if ITEMSIZE.get(info.dtype, 0):  # sub-byte sources are read whole, apart
                            spans.setdefault(info.file_index, []).append(_region_extent(info, reg))
        return spans

    def announce_reads(self, only: int | None = None) -> None:
        """Tells an engine that fetches ahead (``will_read``: remote loads) every span this
        load reads, so it can fetch gaps between one bucket's spans that a later bucket reads."""
        engine = getattr(self.ckpt, "engine", None)
        will_read = getattr(engine, "will_read", None)
        if will_read is not None:  # always called: a load that announces nothing clears the last one's
            ahead = self._announces and bool(getattr(engine, "fetches_ahead", True))
            will_read(self.source_spans(only) if ahead else {})

    def _announce(self, batch: OpBatch, bucket: Bucket) -> bool:
        """Hands ``batch``'s ops to a read-ahead engine (cold reads) before it runs, which
        starts reading them as soon as it has a free buffer; False where it cannot.

        Not for batches whose sources are built by transformers' own ops or dequantized
        (those hold one source group at a time, or read through the files), nor for
        engines without read-ahead (``expect``)."""
        expect = getattr(self.ckpt.engine, "expect", None)
        if expect is None or not self._announces or batch.dequantizing:
            return False
        if self._index is None:
            self._index = {id(b): i for i, b in enumerate(self.plan.buckets)}
        rows = batch.copy_rows()
        expect(rows.ctypes.data, rows.nbytes, self._index.get(id(bucket), -1))
        return True

    def _prebuild(self, bucket: Bucket, slot: torch.Tensor, only: int | None) -> None:
        """Builds and announces the next bucket's ops; a bucket whose ops cannot be built
        is left to its own ``pack``, so its error is raised for it, not for this one."""
        try:
            batch = self._build(bucket, slot, only)
        except Exception:  # noqa: BLE001 - raised again when that bucket is packed
            return
        if self._announce(batch, bucket):
            self._next = (bucket, slot.data_ptr(), slot.numel(), only, batch)

    def pack(self, bucket: Bucket, slot: torch.Tensor, only: int | None = None) -> torch.Tensor:
        """Packs ``bucket`` into ``slot``; returns the filled prefix (the wire bytes).

        With ``only``, packs that rank's segments alone: into its shards when
        it is the bucket's direct rank, else to the start of ``slot``. When the
        pipeline set ``upcoming`` (the bucket packed next and its slot, which nothing
        reads or writes until then where ``lands_ahead``), that bucket's reads may start
        now and land in its slot, while this one is copied and scattered; it is
        consumed by this call.
        """
        then, self.upcoming = self.upcoming, None
        need = bucket.wire_total if only is None else bucket.wire_bytes(only)
        if need > slot.numel():
            raise ValueError(f"bucket of {need} bytes exceeds the {slot.numel()}-byte staging slot")
        ahead, self._next = self._next, None
        prebuilt = (
            ahead is not None and ahead[0] is bucket and ahead[1:4] == (slot.data_ptr(), slot.numel(), only)
        )
        # A prebuilt batch was announced while the previous bucket was packed.
        batch = ahead[4] if ahead is not None and prebuilt else self._build(bucket, slot, only)
        try:
            # This batch is announced first, so the next bucket's reads queue behind its own.
            if then is not None and (prebuilt or self._announce(batch, bucket)):
                self._prebuild(then[0], then[1], only)
            self.bytes_read += batch.execute(self.ckpt.engine, self.ckpt.files)
        except BaseException:
            # Reads announced for this bucket or the next must not outlive the failure: a
            # retry with the same ops would otherwise take their (possibly stale) buffers.
            self.drain()
            raise
        finally:
            self._keep.clear()
            release = getattr(self.ckpt, "release", None)
            if release is not None:
                release()
        return slot[:need]
