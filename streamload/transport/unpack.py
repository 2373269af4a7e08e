"""Unpack (every rank): segments of a received bucket -> local shards.

The wire carries each parameter's own dtype, except bf16 for an f32 parameter
(``plan.buckets.RECEIVER_CASTS``): the one cast made here, a 16-bit shift of the
bits. On the CPU torch's ``copy_`` is that very shift; on a device it is done
with integer ops, so no conversion instruction of the device (whose NaNs differ
from the CPU's) ever decides a bit."""

from __future__ import annotations

import torch

from ..io.copy_ops import TORCH_DTYPES
from ..plan.buckets import Bucket


def widen_bf16_bits(dest: torch.Tensor, wire: torch.Tensor) -> None:
    """``dest`` (f32) = ``wire`` (bf16) widened with integer ops only: each f32 is the bf16's
    bits shifted left by 16, as torch's CPU cast makes it (NaN payloads and signs kept).

    Args:
        dest: an f32 view (any strides) to write.
        wire: bf16 values of ``dest``'s shape.

    Example:
        >>> widen_bf16_bits(shard[rows], wire)  # == shard[rows].copy_(wire) on the CPU
    """
    bits = dest.view(torch.int32)
    bits.copy_(wire.view(torch.int16))  # sign-extends: the high half is shifted out below
    bits.bitwise_left_shift_(16)


def cast_into(dest: torch.Tensor, wire: torch.Tensor) -> None:
    """Writes ``wire`` into ``dest``: a copy, or the one receiver cast (see the module docstring).

    Raises:
        AssertionError: a cast the plan never asks a receiver for (``wire_dtype``).
    """
    if wire.dtype == dest.dtype:
        dest.copy_(wire)
    elif (wire.dtype, dest.dtype) == (torch.bfloat16, torch.float32):
        if dest.device.type == "cpu":
            dest.copy_(wire)  # torch's CPU cast is the shift itself, and faster
        else:
            widen_bf16_bits(dest, wire)
    else:
        raise AssertionError(f"a receiver casts bf16 -> f32 only, not {wire.dtype} -> {dest.dtype}")


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
        cast_into(dest[index], wire)
        total += seg.nbytes
    return total
