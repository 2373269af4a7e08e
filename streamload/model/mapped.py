"""Mapped shards (CPU): a rank that reads its own shard from the files, where
that shard is one contiguous byte range of one checkpoint tensor already in
the parameter's dtype, gets a copy-on-write view of the file instead of a
copy - what safetensors and transformers give CPU tensors.

The file is opened read-only and mapped MAP_PRIVATE: writes to the parameter
(an optimizer step) land in private pages, never in the file. Pages are read
when first touched and are the page cache's own (shared by every rank that
holds the same bytes), so nothing anonymous is allocated for them.

The caveat is safetensors' own: rewriting a checkpoint file in place while
the model lives changes (or, when it shrinks, invalidates: SIGBUS) the pages
not yet written - e.g. ``save_pretrained`` into the directory the model was
loaded from. So ``map_files="auto"`` maps only files this process cannot write
(``os.access(W_OK)`` is false: read-only files for this user, a read-only
mount); shards of writable files are copied. Unlinking or renaming a mapped
file is harmless (the mapping keeps its inode), so the directory's own
permissions do not matter. ``map_files=True`` maps writable files too;
``map_files=False`` gives private copies only.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..io.checkpoint import Checkpoint
from ..io.copy_ops import ITEMSIZE, ST_DTYPES, contiguous_strides
from ..plan.buckets import Target
from ..plan.regions import Box, regions_for_box

log = logging.getLogger("streamload")


@dataclass
class MappedShards:
    """Targets whose local shard is now a view of the file, and their bytes."""

    targets: frozenset[int] = frozenset()
    nbytes: int = 0
    ranges: list[tuple[int, int, int]] = field(default_factory=list)  # (file index, offset, bytes)
    writable: list[str] = field(default_factory=list)  # files whose shards were copied: writable here


def is_contiguous_box(start: Sequence[int], extent: Sequence[int], full: Sequence[int]) -> bool:
    """Whether the sub-box [start, start + extent) of a row-major array of
    shape ``full`` is one contiguous run of elements."""
    partial = False
    for e, f in zip(reversed(extent), reversed(full), strict=True):
        if partial and e != 1:
            return False
        if e != f:
            partial = True
    return True


def file_range(target: Target, box: Box, dtype: torch.dtype, ckpt: Checkpoint) -> tuple[int, int] | None:
    """(file index, absolute byte offset) of the bytes of ``box``, when they
    lie contiguously in one file tensor stored in ``dtype``; else None."""
    regions = list(regions_for_box(target.pieces, box))
    if len(regions) != 1 or math.prod(hi - lo for lo, hi in box) == 0:
        return None
    reg = regions[0]
    if reg.key not in ckpt or tuple(reg.shape) != tuple(hi - lo for lo, hi in box):
        return None
    info = ckpt.info(reg.key)
    walked = [d for d in reg.dims if d is not None]
    if info.dtype != ST_DTYPES.get(dtype) or walked != list(range(len(info.shape))):
        return None  # a cast, a transpose or a reordering needs a copy
    extent = [n for n, d in zip(reg.shape, reg.dims, strict=True) if d is not None]
    if not is_contiguous_box(reg.src_start, extent, info.shape):
        return None
    first = sum(s * st for s, st in zip(reg.src_start, contiguous_strides(info.shape), strict=True))
    offset = info.offset + first * ITEMSIZE[info.dtype]
    if offset % ITEMSIZE[info.dtype]:
        return None
    return info.file_index, offset


def _spans_storage(local: torch.Tensor) -> bool:
    """The local tensor is all of its storage (FSDP's padded shards are not)."""
    return (
        local.device.type == "cpu"
        and local.is_contiguous()
        and local.storage_offset() == 0
        and local.untyped_storage().nbytes() == local.numel() * local.element_size()
    )


# Beyond this many mappings in one load, shards are copied: the kernel's
# per-process limit (vm.max_map_count, 65530 by default) is shared with
# everything else the process maps.
MAX_MAPPINGS = 16384


def shard_view(ckpt: Checkpoint, index: int, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A copy-on-write view of the ``like.nbytes`` file bytes at ``offset``,
    shaped like ``like``, whose storage is exactly those bytes.

    One private mapping per shard (its start aligned down to the page): the
    storage is the shard alone, so ``torch.save`` or pickling a parameter
    writes its own bytes, not the whole file around it.

    Args:
        ckpt: the checkpoint this rank reads (its validated descriptors are mapped).
        index: file index; offset: absolute byte offset of the shard in that file.
        like: the local shard to replace (shape, dtype; contiguous).

    Returns:
        The view; it keeps its mapping alive.

    Example:
        >>> view = shard_view(ckpt, 0, info.offset, local)
    """
    f = ckpt.files[index]
    nbytes = like.numel() * like.element_size()
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    # The descriptor is the one whose header was validated: no re-open by path.
    region = mmap.mmap(
        f.fileno,
        offset + nbytes - start,
        flags=mmap.MAP_PRIVATE,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
        offset=start,
    )
    raw = torch.frombuffer(memoryview(region)[offset - start : offset - start + nbytes], dtype=torch.uint8)
    return raw.view(like.dtype).view(like.shape)


def fsdp_params(model: nn.Module) -> dict[int, Any] | None:
    """FSDP2's per-parameter state, by ``id`` of the sharded parameter the
    module holds; None when the model has FSDP modules whose internals this
    torch does not expose as expected (then DTensor shards are not mapped).
    A tied alias that FSDP still tracks separately is left out: FSDP folds it
    into the canonical parameter at its lazy init, after the load."""
    out: dict[int, Any] = {}
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            for group in get_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    info = fsdp_param._module_info
                    if getattr(info.module, info.param_name) is fsdp_param.sharded_param:
                        out[id(fsdp_param.sharded_param)] = fsdp_param
        except AttributeError:
            return None
    return out


@torch.no_grad()
def _adopt(param: torch.Tensor, view: torch.Tensor, fsdp_param: Any) -> bool:
    """Makes ``view`` the parameter's local tensor (and FSDP2's sharded
    storage, as ``FSDPModule._apply`` does after tensors were replaced);
    False, with nothing changed, when FSDP does not take it as it is."""
    if not hasattr(param, "_local_tensor"):
        param.data = view
        return True
    before = param._local_tensor
    param._local_tensor = view
    if fsdp_param is None:
        return True
    fsdp_param.reset_sharded_param()
    data = getattr(fsdp_param, "_sharded_param_data", None)
    if (
        param._local_tensor is view
        and data is not None
        and data.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
    ):
        return True
    param._local_tensor = before
    fsdp_param.reset_sharded_param()
    return False


def map_shards(
    targets: Sequence[Target],
    boxes: Sequence[Box],
    params: Sequence[torch.Tensor],
    locals_: list[torch.Tensor],
    ckpt: Checkpoint,
    model: nn.Module,
    want: Callable[[int], bool] = lambda i: True,
    copy_writable: bool = False,
) -> MappedShards:
    """Replaces each mappable local shard by a view of the file.

    Args:
        targets: the plan's targets; ``boxes[i]`` is this rank's box of target i.
        params: the model's tensors (DTensor parameters or plain tensors).
        locals_: their local shards; mapped entries are replaced in place.
        ckpt: the checkpoint this rank reads.
        model: the model (its FSDP2 state is re-pointed at the views).
        want: whether target i may be mapped at all (the ``map_files`` policy).
        copy_writable: copy shards of files this process may write (``map_files="auto"``):
            a save into them while the model lives would change or unmap its pages.

    Returns:
        The mapped targets (their segments need no copy), their bytes, and the
        writable files whose shards were copied.
    """
    out = MappedShards()
    done: set[int] = set()
    managed = fsdp_params(model)
    writable: dict[int, bool] = {}

    def may_map(index: int) -> bool:
        if not copy_writable:
            return True
        if index not in writable:
            writable[index] = os.access(ckpt.files[index].path, os.W_OK)
            if writable[index]:
                out.writable.append(str(ckpt.files[index].path))
        return not writable[index]

    for i, (target, box, param) in enumerate(zip(targets, boxes, params, strict=True)):
        local = locals_[i]
        if len(done) >= MAX_MAPPINGS:
            break
        if not _spans_storage(local) or (managed is None and hasattr(param, "_local_tensor")):
            continue
        if not want(i):
            continue
        where = file_range(target, box, local.dtype, ckpt)
        if where is None or not ckpt.files[where[0]].mapped or not may_map(where[0]):
            continue
        try:
            view = shard_view(ckpt, where[0], where[1], local)
        except (OSError, ValueError):
            continue  # a file system without private mappings: copy instead
        if not _adopt(param, view, (managed or {}).get(id(param))):
            continue
        locals_[i] = view
        done.add(i)
        out.nbytes += local.numel() * local.element_size()
        out.ranges.append((where[0], where[1], local.numel() * local.element_size()))
    out.targets = frozenset(done)
    if out.writable:
        log.info(
            "streamload: map_files='auto' copied the shards of %d checkpoint files this process may write "
            "(a save into them would change mapped weights); map_files=True maps them anyway",
            len(out.writable),
        )
    return out
