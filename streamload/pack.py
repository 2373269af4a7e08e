"""Pack (reader only): gather every rank's segments of a bucket straight from
the mapped files into a staging slot, in one native call per bucket. Fusion,
slicing and narrowing casts happen here."""

from __future__ import annotations

import torch

from .checkpoint import Checkpoint
from .copy_ops import ITEMSIZE, OpBatch, contiguous_strides
from .plan import Bucket, Plan
from .regions import regions_for_box


class StagingRing:
    """``slots`` reusable byte buffers of at most ``bucket_bytes`` each.

    Attributes:
        peak_bytes: the most bytes ever held by the ring's buffers together.
    """

    def __init__(self, slots: int, slot_bytes: int, pin: bool = False) -> None:
        self.slot_bytes = slot_bytes
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self.peak_bytes = slots * slot_bytes

    def __getitem__(self, k: int) -> torch.Tensor:
        return self.slots[k % len(self.slots)]


class Packer:
    """Fills staging slots from a checkpoint according to a plan."""

    def __init__(self, ckpt: Checkpoint, plan: Plan) -> None:
        self.ckpt = ckpt
        self.plan = plan
        self.bytes_read = 0

    def pack(self, bucket: Bucket, slot: torch.Tensor) -> torch.Tensor:
        """Packs ``bucket`` into ``slot``; returns the filled prefix."""
        if bucket.total_bytes > slot.numel():
            raise ValueError(
                f"bucket of {bucket.total_bytes} bytes exceeds the {slot.numel()}-byte staging slot"
            )
        batch = OpBatch()
        for rank, segs in enumerate(bucket.segments):
            base = bucket.rank_base(rank)
            for seg in segs:
                target = self.plan.targets[seg.target]
                isz = ITEMSIZE[seg.wire_dtype]
                seg_shape = [hi - lo for lo, hi in seg.box]
                seg_strides = contiguous_strides(seg_shape)
                first = (base + seg.offset) // isz
                for reg in regions_for_box(target.pieces, seg.box):
                    info = self.ckpt.info(reg.key)
                    src_strides_full = contiguous_strides(info.shape)
                    src_strides = [0 if d is None else src_strides_full[d] for d in reg.dims]
                    batch.add(
                        file=info.file_index,
                        src=info.begin,
                        src_nbytes=info.nbytes,
                        src_dtype=info.dtype,
                        dst=slot,
                        dst_dtype=seg.wire_dtype,
                        shape=reg.shape,
                        src_strides=src_strides,
                        dst_strides=seg_strides,
                        src_offset=sum(s * st for s, st in zip(reg.src_start, src_strides_full, strict=True)),
                        dst_offset=first
                        + sum(b * st for b, st in zip(reg.box_start, seg_strides, strict=True)),
                    )
        self.bytes_read += batch.execute(self.ckpt.engine, self.ckpt.files)
        return slot[: bucket.total_bytes]
