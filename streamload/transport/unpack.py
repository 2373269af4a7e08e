"""Unpack (every rank): segments of a received bucket -> local shards.
Widening casts (bf16 wire -> fp32 parameter) happen here, with torch's own
``copy_``, so they equal torch's cast bit for bit."""

from __future__ import annotations

import torch

from ..io.copy_ops import TORCH_DTYPES
from ..plan.buckets import Bucket


@torch.no_grad()
def unpack(bucket: Bucket, rank: int, recv: torch.Tensor, locals_: list[torch.Tensor]) -> int:
    """Copies this rank's segments from ``recv`` into ``locals_[target]``.

    Args:
        bucket: the plan's bucket.
        rank: this rank.
        recv: the received bytes (this rank's part only).
        locals_: the local shard of every plan target, by target index.

    Returns:
        Bytes unpacked.
    """
    total = 0
    if rank == bucket.direct_rank:
        return 0  # filled in place by the packer
    for seg in bucket.segments[rank]:
        shape = [hi - lo for lo, hi in seg.box]
        wire = recv[seg.offset : seg.offset + seg.nbytes].view(TORCH_DTYPES[seg.wire_dtype]).view(shape)
        dest = locals_[seg.target]
        index = tuple(slice(s, s + n) for s, n in zip(seg.local_start, shape, strict=True))
        dest[index].copy_(wire)
        total += seg.nbytes
    return total
