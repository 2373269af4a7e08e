"""Layer groups: the unit a sync materialises at once, and where each hub tensor sits in its
group's buffer.

A group is what vLLM's ``layerwise_groups`` (``vllm/distributed/weight_transfer/base.py``) makes
of the hub names: one group per decoder layer, keyed on the OUTERMOST integer segment of a name
(``model.layers.3.mlp.experts.7.up_proj.weight`` belongs to layer 3, experts and all), the
names before the first layer in a "pre" group (embeddings) and those after it in a "post" group
(final norm, an untied ``lm_head``). The partition is reimplemented here (the same algorithm,
checked against vLLM's own in the engine tests) so that the main package never imports vLLM.

Each group's hub tensors are laid end to end in one byte buffer, each at a 64-byte aligned
offset in its hub dtype, so a received buffer is already the group's tensors: they are views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..io.copy_ops import ITEMSIZE, TORCH_DTYPES

ALIGN = 64
# After a group's bytes its buffer carries two int32 words that the same collective sums: how many
# ranks failed to pack the group, and the sum of their rank + 1 (``source.py``).
FLAG_BYTES = 8


def _stack_key(name: str) -> tuple[str, int] | None:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def layer_groups(names: Sequence[str]) -> list[list[str]]:
    """Partitions hub names into vLLM's layer groups (``layerwise_groups``' algorithm).

    Args:
        names: hub tensor names, in the source's order.

    Returns:
        The groups: pre (un-indexed names before the first indexed one), one per
        (prefix, index) in first-appearance order of the prefix and ascending index, then post.

    Example:
        >>> layer_groups(["embed.w", "layers.1.a", "layers.0.b", "norm.w"])
        [['embed.w'], ['layers.0.b'], ['layers.1.a'], ['norm.w']]
    """
    pre: list[str] = []
    post: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int]] = []
    for name in names:
        key = _stack_key(name)
        if key is None:
            (post if order else pre).append(name)
            continue
        if key not in stacks:
            stacks[key] = []
            order.append(key)
        stacks[key].append(name)
    prefix_rank: dict[str, int] = {}
    for key in order:
        prefix_rank.setdefault(key[0], len(prefix_rank))
    order.sort(key=lambda key: (prefix_rank[key[0]], key[1]))
    groups: list[list[str]] = [pre] if pre else []
    groups += [stacks[key] for key in order]
    if post:
        groups.append(post)
    return groups


def pre_last(entries: Sequence[tuple[str, str, tuple[int, ...]]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """``entries`` with the names before the first layer (the "pre" group: embeddings) moved to the
    end, where ``layer_groups`` joins them to the "post" group (final norm, head): the same
    partition rule, another pass order.

    Example:
        >>> [e[0] for e in pre_last([("embed", "F32", (2,)), ("l.0.w", "F32", (2,)), ("norm", "F32", (2,))])]
        ['l.0.w', 'norm', 'embed']
    """
    first = next((i for i, e in enumerate(entries) if _stack_key(e[0]) is not None), len(entries))
    if first == len(entries):
        return list(entries)
    return [*entries[first:], *entries[:first]]


@dataclass(frozen=True)
class Slot:
    """One hub tensor's place in its group buffer.

    Attributes:
        name: the name the engine receives it under (a hub name, or an engine alias of one).
        dtype: safetensors dtype name of the hub tensor (the sync's cast applied).
        shape: its global shape.
        offset: byte offset in the group buffer.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of the group buffer ``buf`` (uint8)."""
        return buf[self.offset : self.offset + self.nbytes].view(TORCH_DTYPES[self.dtype]).view(self.shape)

    def over(self, buf: torch.Tensor) -> torch.Tensor:
        """This tensor over ``buf``'s memory (``buf``: uint8, at the start of its storage) as a tensor
        of its own, not a view: no ``_base`` keeps the buffer alive, so ``set_`` can later move it
        to memory of its own and let the buffer go (``source.py``)."""
        dtype = TORCH_DTYPES[self.dtype]
        item = ITEMSIZE[self.dtype]
        assert buf.storage_offset() == 0 and self.offset % item == 0, (buf.storage_offset(), self.offset)
        strides = torch.empty(self.shape, device="meta").stride()  # contiguous
        t = torch.empty(0, dtype=dtype, device=buf.device)
        return t.set_(buf.untyped_storage(), self.offset // item, self.shape, strides)


@dataclass(frozen=True)
class Group:
    """One layer group: its slots in order and its buffer size (a multiple of 8 bytes, so the
    buffer can travel as int32 or int64 words)."""

    index: int
    slots: tuple[Slot, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


def plan_groups(entries: Sequence[tuple[str, str, tuple[int, ...]]]) -> list[Group]:
    """Lays every group's tensors out in its buffer.

    Args:
        entries: (name, safetensors dtype, shape) of every tensor the sync sends, in source order.

    Returns:
        The groups, in ``layer_groups`` order; flattening their names gives the sync's order.

    Example:
        >>> [g.names for g in plan_groups([("a.0.w", "F32", (2,)), ("n", "F32", (3,))])]
        [['a.0.w'], ['n']]
    """
    info = {name: (dt, shape) for name, dt, shape in entries}
    out: list[Group] = []
    for i, names in enumerate(layer_groups([e[0] for e in entries])):
        slots = []
        pos = 0
        for name in names:
            dt, shape = info[name]
            slot = Slot(name, dt, tuple(shape), pos)
            slots.append(slot)
            pos = -(-(pos + slot.nbytes) // ALIGN) * ALIGN
        out.append(Group(i, tuple(slots), max(8, -(-pos // 8) * 8)))
    return out
