"""Group buffers: where a sync's layer groups live on the way to the engine, and what a consumer
may keep of them.

A pass (``source.py`` ``HubSource.iter_groups``, ``remote.py`` on the engine's side) hands the
consumer each group's tensors over one buffer. The consumer's loops keep some of them while they
ask for the next group (vLLM's name mapper: the last stacked shard it passed on); ``let_go`` moves
such holds to memory of their own when nothing else can see them, so one buffer is alive at a
time; ``BufferPool`` reuses a buffer's memory only once nothing holds it; ``planned_peak`` is what
a pass order costs, which picks the order.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from .groups import Group


class BufferPool:
    """Zeroed group buffers for one pass, their memory reused once nothing holds it.

    On the CPU a buffer is a numpy array (``calloc``: fresh pages are zero already and only those
    a group touches become resident) that the group's tensor views through ``torch.from_numpy``;
    the array's reference count (``sys.getrefcount``) tells whether any tensor of that group is
    still alive - the consumer's, or the engine's that kept a view. A free one is reused for the
    next group (no page faults, no new mapping per group), zeroed where the pack will not write;
    one still held is left alone and another made. At the end of a pass one free array may stay
    for the next (``clear(keep=True)``). On a device: a fresh ``torch.zeros`` each time (its
    caching allocator already reuses).
    """

    KEEP = 2

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.arrays: list[np.ndarray] = []
        self.made: list[weakref.ref[np.ndarray]] = []  # every array of the pass
        self.most_held = 0  # the most group buffers held at once (by anyone) in the pass

    def take(self, nbytes: int, size: int, gaps: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (arrays of ``size`` bytes, the largest group's), zero
        where the caller will not write: in ``gaps`` (byte ranges), or everywhere when None."""
        if self.device.type != "cpu":
            return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.most_held = max(self.most_held, self._held() + 1)
        for i in range(len(self.arrays)):
            # The list's reference and getrefcount's own argument: no tensor holds this array.
            if self.arrays[i].nbytes >= nbytes and sys.getrefcount(self.arrays[i]) == 2:
                buf = torch.from_numpy(self.arrays[i][:nbytes])
                if gaps is None:
                    buf.zero_()
                else:  # the rest is written over: zeroing it too would double the pack's writes
                    for lo, hi in gaps:
                        buf[lo:hi].zero_()
                return buf
        arr = np.zeros(max(nbytes, size), dtype=np.uint8)
        self.made.append(weakref.ref(arr))
        if len(self.arrays) < self.KEEP:
            self.arrays.append(arr)
        return torch.from_numpy(arr[:nbytes])

    def _held(self) -> int:
        """How many of the pass's arrays a tensor still holds."""
        pooled = {id(a) for a in self.arrays}
        n = 0
        for r in self.made:
            a = r()
            # References here: ``a``, getrefcount's argument, and the pool's list if pooled.
            if a is not None and sys.getrefcount(a) > 2 + (id(a) in pooled):
                n += 1
            del a
        return n

    def clear(self, keep: bool = False) -> int:
        """Ends the pass; returns the most group buffers that were held at once in it.

        ``keep``: one array nothing holds stays for the next pass, its pages resident (a fresh
        one costs its page faults again: ~0.1 s per 250 MiB of 4 KiB pages here, more where
        transparent huge pages need compacting), as torch's caching allocator keeps device memory.
        """
        most, self.most_held = self.most_held, 0
        # References to a free array here: the list's, ``a``'s and getrefcount's argument.
        kept = [a for a in self.arrays if sys.getrefcount(a) == 3][:1] if keep else []
        self.arrays, self.made = kept, [weakref.ref(a) for a in kept]
        return most

    @property
    def kept_bytes(self) -> int:
        """Bytes this pool keeps between passes (``clear(keep=True)``)."""
        return sum(a.nbytes for a in self.arrays)


class Handout:
    """The group a pass last handed to its consumer (weak references to its tensors, the buffer's
    storage address and size); ``take_back`` before the next group moves what the consumer still
    holds of it off the buffer (``let_go``)."""

    def __init__(self) -> None:
        self.given: list[weakref.ref[torch.Tensor]] = []
        self.at = 0
        self.nbytes = 0

    def give(self, tensors: Sequence[torch.Tensor | None], buf: torch.Tensor, nbytes: int) -> None:
        """Records ``tensors`` (over ``buf``, a group of ``nbytes``) as handed out."""
        self.given = [weakref.ref(t) for t in tensors if t is not None]
        self.at, self.nbytes = buf.untyped_storage().data_ptr(), nbytes

    def take_back(self) -> int:
        """Moves off the buffer what the consumer still holds of the last group; returns the bytes."""
        moved = let_go(self.given, self.at, self.nbytes) if self.at else 0
        self.given, self.at = [], 0
        return moved


def let_go(given: list[weakref.ref[torch.Tensor]], at: int, nbytes: int) -> int:
    """Moves the tensors of a group that a consumer still holds (``given``, over the buffer whose
    storage starts at ``at``, of ``nbytes``) to memory of their own, when they are at most half the
    group: the same tensor objects with the same values, and the buffer free. Returns the bytes moved.

    Only tensors nothing else can see are moved: each tensor's own use count is 1 (no view of it,
    no DLPack export, no autograd save, no C++ holder: those would keep reading the old memory) and
    no other tensor shares the buffer's storage; otherwise the buffer stays, and the pool never
    reuses a buffer anything holds. Never raises (a tensor that cannot be moved, e.g. an inference
    tensor outside inference mode, keeps its buffer)."""
    held = _held_over(given, at)
    moved = sum(t.nbytes for t in held)
    if not held or moved > nbytes // 2 or len({t.data_ptr() for t in held}) < len(held):
        return 0  # nothing held, too much to copy, or aliases (moved apart they would stop sharing)
    try:
        if any(t._use_count() != 1 or t.requires_grad for t in held):  # type: ignore[attr-defined]
            return 0
        # Each held tensor and this temporary storage object: no one else on the buffer's storage.
        if torch._C._storage_Use_Count(held[0].untyped_storage()._cdata) != len(held) + 1:
            return 0
        with torch.no_grad():
            for t in held:
                copy = t.clone()
                t.set_(copy.untyped_storage(), 0, copy.shape, copy.stride())
    except Exception:  # noqa: BLE001 - the buffer is kept instead; nothing was lost
        return 0
    return moved


def wait_released(words: torch.Tensor, limit: float = 0.05) -> None:
    """Waits (at most ``limit`` seconds) until a finished collective's worker thread has let go of
    ``words`` (gloo's holds it for a moment after the wait returned), so that the group's buffer is
    not taken for one still held when the next group is made. Only this rank's own reference left:
    its use count is 1 (a view, another holder, would count too: none is made of ``words``)."""
    if words.device.type != "cpu":
        return
    end = time.monotonic() + limit
    while words._use_count() > 1 and time.monotonic() < end:  # type: ignore[attr-defined]
        time.sleep(0.0005)


def _held_over(given: list[weakref.ref[torch.Tensor]], at: int) -> list[torch.Tensor]:
    """The tensors of ``given`` still alive and still over the buffer whose storage starts at ``at``."""
    out = []
    for r in given:
        t = r()
        if t is not None and t.untyped_storage().data_ptr() == at:
            out.append(t)
    return out


def zero_gaps(total: int, regions: Sequence[torch.Tensor]) -> list[tuple[int, int]] | None:
    """The byte ranges of a ``total``-byte buffer that no region covers, in order; None when a
    region is not one contiguous block (the whole buffer is zeroed then).

    Args:
        total: the buffer's size in bytes.
        regions: views of the buffer (any dtype; a meta buffer will do) that the pack fills.

    Example:
        >>> b = torch.empty(16, dtype=torch.uint8, device="meta")
        >>> zero_gaps(16, [b[4:8], b[10:12]])
        [(0, 4), (8, 10), (12, 16)]
    """
    covered = []
    for v in regions:
        if v.numel() == 0:
            continue
        if not v.is_contiguous():
            return None
        lo = int(v.storage_offset()) * v.element_size()
        covered.append((lo, lo + v.numel() * v.element_size()))
    gaps, pos = [], 0
    for lo, hi in sorted(covered):
        if lo > pos:
            gaps.append((pos, lo))
        pos = max(pos, hi)
    if pos < total:
        gaps.append((pos, total))
    return gaps


def pinned_bytes(g: Group) -> int:
    """What a consumer still holding ``g``'s last tensor keeps alive while the next group is made:
    a copy of that tensor (``let_go``), or the group's buffer when the tensor is over half of it."""
    last = g.slots[-1].nbytes
    return last if last <= g.nbytes // 2 else g.nbytes


def planned_peak(groups: Sequence[Group]) -> int:
    """A pass's peak extra memory: each group's buffer plus what the previous one leaves pinned."""
    peak, pinned = 0, 0
    for g in groups:
        peak = max(peak, g.nbytes + pinned)
        pinned = pinned_bytes(g)
    return peak
