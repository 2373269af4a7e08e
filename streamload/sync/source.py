"""HubSource: the trainer's weights in hub layout, one layer group at a time, one collective each.

The plan is the save's (``save/layout.py`` ``output_layout``, ``save/plan.py`` ``plan_save``):
hub names (transformers' reverse conversion: fused experts back to per-expert tensors, computed
on meta tensors of the global shapes), ties stored once, the cast, and every rank's pieces of
every hub tensor, proven once to tile each hub tensor exactly (``save/tiling.py``
``check_tiling``). A sync then runs the plan group by group (``groups.py``):

1. every rank copies its own pieces into their places in one buffer of the group's size (the
   cast happens in this copy), straight from its local shards, and zeroes the rest of it (a
   reused buffer only there: ``buffers.zero_gaps``);
2. ONE collective over the group's buffer, viewed as int32 words: ``all_reduce(SUM)`` when every
   rank receives (colocated engines), ``reduce(SUM)`` to the one receiving rank otherwise. Every
   byte is written by exactly one rank and is zero on all others, and integer addition of zeros
   is exact, so the sum is the bytes, bit for bit (NaN payloads and signed zeros included) - no
   float arithmetic ever touches a weight;
3. the receivers yield the group's tensors over the buffer's memory (no unpack copy). Before the
   next group is made, any of them a consumer still holds (a loop variable: vLLM's name mapper keeps
   the last stacked shard it passed on) is moved to memory of its own (``Tensor.set_``, the same
   object and values) when that is at most half the group, so the buffer goes; a larger one keeps
   its buffer (the engine may keep whatever it took: nothing is ever overwritten under it).

Peak extra memory per rank: one group buffer (the largest layer, its experts included), never a
fused full tensor and never a full model; on the CPU that buffer stays resident for the next pass
(``keep_buffer``) unless a consumer still holds it. The pass order is the one whose planned peak is lower:
the embeddings first (vLLM's order) or last, in the final group (``groups.pre_last``) - a tied
embedding and its alias end their group with a tensor as large as the group, which a consumer's
loop variable would pin while the next group is made. vLLM's ``WeightSource`` shape (``metadata``,
``__iter__``, ``iter_groups``, ``held_names``, ``groups``) is implemented without importing
vLLM; ``vllm_weight_source`` wraps it into vLLM's own ABC where a backend checks the type.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import SaveError
from ..model.placement import resolve_device, resolve_group
from ..save.layout import Layout, output_layout
from ..save.plan import Piece, SavePlan, local_of, plan_save
from ..save.tiling import check_tiling
from ..transport.arrival import current, wait_work
from ..transport.collectives import solo
from ..transport.protocol import carries_cpu
from .buffers import BufferPool, Handout, planned_peak, wait_released, zero_gaps
from .errors import SyncError
from .groups import FLAG_BYTES, Group, Slot, plan_groups, pre_last

ALL = "all"


@dataclass(frozen=True)
class ParamMeta:
    """Name, wire dtype and full (hub) shape of one tensor a sync yields (vLLM's ``ParamMeta``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class SourceStats:
    """What the passes of one HubSource did on this rank (cumulative).

    Attributes:
        passes: full passes iterated.
        groups: groups materialised.
        collectives: collectives issued for data (one per group when ranks > 1).
        bytes: group buffer bytes materialised.
        peak_group_bytes: the largest group buffer (the peak extra memory of a pass).
        pack_seconds: time spent zeroing and copying own pieces (sender-side assembly).
        wire_seconds: time spent in the collectives.
        held_groups: the most group buffers alive at once in the last pass (on the CPU: the one being
            made and any an earlier group's tensors still held - the consumer's, the engine's).
        moved_bytes: bytes of earlier groups' tensors still held when the next group was made, moved
            to memory of their own so that their group's buffer could go.
    """

    passes: int = 0
    groups: int = 0
    collectives: int = 0
    bytes: int = 0
    peak_group_bytes: int = 0
    pack_seconds: float = 0.0
    wire_seconds: float = 0.0
    held_groups: int = 0
    moved_bytes: int = 0
    per_pass: list[int] = field(default_factory=list)


class HubSource:
    """The trainer's weights as the hub checkpoint ``save_pretrained`` would write, streamed.

    Collective to build (the plan's tiling is agreed once) and to iterate: every rank of the
    group iterates every group in the same order.

    Args:
        model: the trainer's model (FSDP2 / DTensor parameters, or plain).
        dtype: cast floating-point tensors to this dtype (as ``save_pretrained(dtype=)``).
        receivers: ``"all"`` (every rank gets every tensor: colocated engines) or the group
            rank that receives (one engine fed by one rank); other ranks yield ``None`` tensors.
        process_group: the trainer's group (default: ``device_mesh``'s, else the default group).
        device_mesh: the model's mesh (finds the group and the device of the wire).
        aliases: hub name -> further names the engine must receive the same tensor under
            (an engine that keeps its own copy of a tied weight: ``{"model.embed_tokens.weight":
            ["lm_head.weight"]}``).
        layout: the output layout, when the caller planned it already.
        transfer: ``(process group, rank)``: the data travels over this group instead, to that
            rank of it - a group made for the transfer only (e.g. every trainer rank plus an
            engine process, ``remote.py``), never registered with torch.distributed (its
            collectives are the group object's own methods); no trainer rank receives then.
        watch: called while a collective waits (once a second); raises when what the collective
            also waits on is gone (``RemoteEngine.ping``: the engine's process). Inside a call
            (``sync_weights``) each collective waits at most the call's ``timeout``.
        keep_buffer: on the CPU, keep one group buffer (the largest group's size) between passes,
            its pages resident, so the next pass does not fault a fresh one in; ``release``
            frees it. False: every pass ends with no buffer. (On a device torch's caching
            allocator keeps the memory either way.)

    Raises:
        SaveError: the model has a tensor with no hub form, or the ranks' shards do not tile
            the hub tensors exactly (on every rank).

    Example:
        >>> src = HubSource(model)
        >>> for name, tensor in src:  # one all_reduce per layer group
        ...     engine_weights[name].copy_(tensor)
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        receivers: str | int = ALL,
        process_group: dist.ProcessGroup | None = None,
        device_mesh: Any = None,
        aliases: Mapping[str, Sequence[str]] | None = None,
        layout: Layout | None = None,
        transfer: tuple[Any, int] | None = None,
        watch: Callable[[], None] | None = None,
        keep_buffer: bool = True,
    ) -> None:
        if receivers != ALL and not isinstance(receivers, int):
            raise ValueError(f"receivers must be 'all' or a group rank, not {receivers!r}")
        self.group = resolve_group(process_group, device_mesh)
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        if isinstance(receivers, int) and not 0 <= receivers < self.world:
            raise ValueError(f"receivers={receivers} is not a rank of a {self.world}-rank group")
        self.receivers = receivers
        self.transfer = transfer
        self.watch = watch
        self.failed: SyncError | None = None  # this rank's failure in the pass under way
        self.peer_failed: SyncError | None = None  # a peer's, as the flag told it
        self.device = (
            torch.device("cpu")
            if self.group is None or carries_cpu(self.group)
            else resolve_device(model, device_mesh, self.group)
        )
        self.layout = layout if layout is not None else output_layout(model, dtype=dtype)
        plan = plan_save(model, self.layout, self.rank)
        self.plan: SavePlan = check_tiling(self.layout, plan, self.group, self.device)
        self.aliases = {k: list(v) for k, v in (aliases or {}).items()}
        unknown = [k for k in self.aliases if k not in self.layout.tensors]
        if unknown:
            raise SaveError(f"aliases name tensors the trainer does not have: {unknown}", tensor=unknown[0])
        names = [a for v in self.aliases.values() for a in v]
        clash = sorted({a for a in names if a in self.layout.tensors or names.count(a) > 1})
        if clash:
            # An alias that is itself a tensor sent (or named twice) would take that tensor's bytes
            # into the aliased slot: refused, named.
            raise SaveError(
                f"aliases must be names the trainer does not send, each once: {clash}", tensor=clash[0]
            )
        entries = [(name, h.dtype, h.shape) for name, h in self.layout.tensors.items()]
        # The pass order: the layout's (vLLM's, embeddings first) or the embeddings last, whichever
        # plans the lower peak - decided from the hub tensors alone (not the aliases, which the
        # ranks may not share), so every rank takes the same order.
        order = min((entries, pre_last(entries)), key=lambda e: planned_peak(self._plan(e, {})))
        self._groups = self._plan(order, self.aliases)
        by_name: dict[str, list[Piece]] = {}
        for p in self.plan.pieces:
            by_name.setdefault(p.key, []).append(p)
        self._pieces = [[(s, p) for s in g.slots for p in by_name.get(s.name, ())] for g in self._groups]
        # What a reused buffer must have zeroed: the bytes this rank's pieces do not write over.
        self._gaps = [
            self._zero_gaps(g, pieces) for g, pieces in zip(self._groups, self._pieces, strict=True)
        ]
        self.stats = SourceStats()
        self._pool = BufferPool(self.device)
        self.keep_buffer = keep_buffer

    @staticmethod
    def _plan(
        entries: list[tuple[str, str, tuple[int, ...]]], aliases: Mapping[str, list[str]]
    ) -> list[Group]:
        """The groups of ``entries`` in that order, aliases beside their tensors, each group's
        smallest tensor last (what a consumer is left holding when it asks for the next group)."""
        # An alias is the same slot again under the engine's other name, in its tensor's group:
        # no bytes packed, sent or held twice (a tied embedding is the largest tensor of many models).
        return [
            Group(
                g.index,
                _smallest_last(
                    [x for s in g.slots for x in (s, *(replace(s, name=a) for a in aliases.get(s.name, ())))]
                ),
                g.nbytes,
            )
            for g in plan_groups(entries)
        ]

    @staticmethod
    def _zero_gaps(g: Group, pieces: list[tuple[Slot, Piece]]) -> list[tuple[int, int]] | None:
        meta = torch.empty(g.nbytes + FLAG_BYTES, dtype=torch.uint8, device="meta")
        return zero_gaps(meta.numel(), [_region(slot, piece, meta) for slot, piece in pieces])

    # -- vLLM's WeightSource shape -------------------------------------------------------------

    def metadata(self) -> list[ParamMeta]:
        """(name, dtype, full shape) of every tensor a pass yields, in yield order; no transfer.

        Example:
            >>> HubSource(model).metadata()[0]
            ParamMeta(name='model.layers.0.self_attn.q_proj.weight', dtype=torch.float32, shape=(128, 128))
        """
        from ..io.copy_ops import TORCH_DTYPES

        return [ParamMeta(s.name, TORCH_DTYPES[s.dtype], s.shape) for g in self._groups for s in g.slots]

    def held_names(self) -> Collection[str] | None:
        """None: every rank takes part in every group's collective (vLLM's "holds all")."""
        return None

    def groups(self) -> list[list[str]]:
        """The layer groups' names, in order (vLLM's ``layerwise_groups`` of ``metadata()``)."""
        return [g.names for g in self._groups]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """A fresh pass: ``(name, tensor)`` in ``metadata()`` order, one collective per group.

        On ranks that do not receive (``receivers`` = another rank) the tensors are None.

        No reference to a group's tensors is left here when the next group is materialised
        (only the consumer's own, to the last tensor it took, moved off the buffer: ``iter_groups``).
        """
        for names, tensors in self.iter_groups():
            pairs = list(zip(names, tensors, strict=True))[::-1]
            del names, tensors
            while pairs:
                yield pairs.pop()

    def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor | None]]]:
        """A fresh pass, one ``(names, tensors)`` batch per layer group (one collective each).

        A rank that fails to pack group k (or is told to stop, ``abort``) still takes part in the
        collectives, with zeros and its flag set in the buffer's trailing words: with
        ``receivers="all"`` every rank sees the flag in group k's result and the pass stops there
        on every rank (the failing rank raises its error, the others a ``SyncError`` naming it);
        with one receiver only that rank sees it, so every rank goes on to the end of the pass
        (the receiver yields nothing more) and raises then.

        Raises:
            SyncError: this rank failed to pack a group (naming it and the tensor), or a peer did.

        Example:
            >>> for names, tensors in HubSource(model).iter_groups():
            ...     engine.load_weights(zip(names, tensors))
        """
        before = self.stats.collectives
        self.failed = None
        self.peer_failed = None
        stop_early = self.transfer is None and self.receivers == ALL
        handout = Handout()
        try:
            for g in self._groups:
                self.stats.moved_bytes += handout.take_back()
                buf = self._materialise(g)
                if self.failed is not None or self.peer_failed is not None:
                    del buf
                    if stop_early or g is self._groups[-1]:
                        break
                    continue
                if buf is None:
                    yield g.names, [None] * len(g.slots)
                else:
                    tensors: list[torch.Tensor | None] = [s.over(buf) for s in g.slots]
                    handout.give(tensors, buf, g.nbytes)
                    yield g.names, tensors
                    del tensors
                del buf
            # What the consumer still holds of the last group moves off its buffer as at every
            # group (``let_go``'s rules), so that buffer can be the one kept for the next pass; one
            # the consumer holds more of is let go to it, never reused.
            self.stats.moved_bytes += handout.take_back()
        finally:
            # However the pass ends (a consumer that stops early, a peer lost): a failure's
            # traceback no longer pins the group buffer it was packing, and only a free buffer
            # is kept, only with ``keep_buffer``.
            for err in (self.failed, self.peer_failed):
                for e in (err, err and err.__cause__):
                    if e is not None:
                        traceback.clear_frames(e.__traceback__)
            self.stats.held_groups = self._pool.clear(keep=self.keep_buffer)
        self.stats.passes += 1
        self.stats.per_pass.append(self.stats.collectives - before)
        if self.failed is not None:
            raise self.failed
        if self.peer_failed is not None:
            raise self.peer_failed

    def release(self) -> None:
        """Frees the group buffer kept between passes (``keep_buffer``)."""
        self._pool.clear()

    @property
    def kept_bytes(self) -> int:
        """Host bytes kept between passes (one group buffer with ``keep_buffer``, else 0)."""
        return self._pool.kept_bytes

    def abort(self, exc: BaseException) -> None:
        """Stops the pass under way on every rank: this rank's next group travels as zeros with its
        flag set (see ``iter_groups``); the pass then raises ``exc``, as a ``SyncError``."""
        self.failed = _as_failure(exc, self.rank, None)

    # -- one group -----------------------------------------------------------------------------

    @property
    def receives(self) -> bool:
        """Whether this rank gets the tensors."""
        if self.transfer is not None:
            return False
        return self.receivers == ALL or self.receivers == self.rank

    @property
    def planned_groups(self) -> list[Group]:
        """The layer groups' layout (slots and buffer sizes), in pass order."""
        return list(self._groups)

    @property
    def largest_group_bytes(self) -> int:
        """The largest group buffer: the peak extra memory of a pass on every rank."""
        return max((g.nbytes for g in self._groups), default=0) + FLAG_BYTES

    def _materialise(self, g: Group) -> torch.Tensor | None:
        t0 = time.perf_counter()
        # The group's bytes, then FLAG_BYTES: (ranks failed, sum of their rank + 1) as int32
        # words, summed by the same collective (no extra one).
        buf = self._pool.take(g.nbytes + FLAG_BYTES, self.largest_group_bytes, self._gaps[g.index])
        if self.failed is None:
            slot: Slot | None = None
            try:
                for slot, piece in self._pieces[g.index]:
                    _region(slot, piece, buf).copy_(piece.view(local_of(self.plan.tensors[piece.target])))
            except Exception as exc:  # noqa: BLE001 - sent as the flag, raised after the collective
                self.failed = _as_failure(exc, self.rank, slot.name if slot is not None else None, g)
        if self.failed is not None:
            buf.zero_()
            buf[g.nbytes :].view(torch.int32)[:2] = torch.tensor([1, self.rank + 1], dtype=torch.int32)
        t1 = time.perf_counter()
        self.stats.pack_seconds += t1 - t0
        self.stats.groups += 1
        self.stats.bytes += buf.numel()
        self.stats.peak_group_bytes = max(self.stats.peak_group_bytes, buf.numel())
        words = buf.view(torch.int32)
        if self.transfer is not None:
            pg, root = self.transfer
            opts = dist.ReduceOptions()
            opts.rootRank = root
            opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
            wait_work(pg.reduce([words], opts), self.device, deadline=_deadline(), watch=self.watch)
            wait_released(words)
            self.stats.collectives += 1
        elif not solo(self.group):
            if self.receivers == ALL:
                work = dist.all_reduce(words, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            else:
                assert self.group is not None  # not solo
                dst = dist.get_global_rank(self.group, int(self.receivers))
                work = dist.reduce(words, dst=dst, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            wait_work(work, self.device, deadline=_deadline(), watch=self.watch)
            del work
            wait_released(words)
            self.stats.collectives += 1
        self.stats.wire_seconds += time.perf_counter() - t1
        if not self.receives:
            return None
        count, ids = (int(x) for x in buf[g.nbytes :].view(torch.int32)[:2].tolist())
        if count and self.failed is None and self.peer_failed is None:
            self.peer_failed = peer_failure(count, ids, g)
        return buf[: g.nbytes]


def _smallest_last(slots: list[Slot]) -> tuple[Slot, ...]:
    """``slots`` in order, their smallest moved last (a consumer's loop holds the last tensor it
    took while it asks for the next group: ``let_go`` moves a small one off the buffer); an
    alias stays right after its tensor."""
    if len(slots) < 2:
        return tuple(slots)
    small = min(range(len(slots)), key=lambda i: (slots[i].nbytes, -i))
    if any(s.offset == slots[small].offset for j, s in enumerate(slots) if j != small):
        return tuple(slots)  # an aliased tensor: it and its aliases keep their places
    return (*slots[:small], *slots[small + 1 :], slots[small])


def _deadline() -> float | None:
    """A sync's collective waits at most its call's ``timeout`` (each waits on one step of every
    peer: longer means a peer is gone or stuck)."""
    m = current()
    return None if m is None else m.timeout


def peer_failure(count: int, ids: int, g: Group) -> SyncError:
    """What a rank raises when a group's flag words say ``count`` peers failed to pack it (the
    failing rank's own error, with the tensor, comes with the call's agreement)."""
    who = f"rank {ids - 1}" if count == 1 else f"{count} ranks"
    return SyncError(
        f"{who} failed to pack layer group {g.index} ('{g.slots[0].name}', ...): the pass stopped",
        rank=ids - 1 if count == 1 else None,
    )


def _as_failure(exc: BaseException, rank: int, tensor: str | None, g: Group | None = None) -> SyncError:
    if isinstance(exc, SyncError):
        return exc
    where = f" packing layer group {g.index}" if g is not None else ""
    err = SyncError(f"failed{where} ({type(exc).__name__}: {exc})", tensor=tensor, rank=rank)
    err.__cause__ = exc
    return err


def _region(slot: Slot, piece: Piece, buf: torch.Tensor) -> torch.Tensor:
    """The part of ``slot``'s tensor in ``buf`` that ``piece`` fills (hub dim order)."""
    v = slot.view(buf)
    for d, (lo, n) in enumerate(zip(piece.src_start, piece.hub_shape(), strict=True)):
        v = v.narrow(d, lo, n)
    return v


_VLLM_CLASS: list[type] = []


def vllm_weight_source(source: HubSource) -> Any:
    """``source`` as an instance of vLLM's own ``WeightSource`` ABC (imports vLLM).

    For vLLM trainer engines that type-check their source; the plain ``HubSource`` already has
    the protocol's methods.

    Example:
        >>> from vllm.distributed.weight_transfer.base import WeightSource
        >>> isinstance(vllm_weight_source(HubSource(model)), WeightSource)
        True
    """
    if not _VLLM_CLASS:
        from vllm.distributed.weight_transfer.base import ParamMeta as VParamMeta
        from vllm.distributed.weight_transfer.base import WeightSource

        class StreamloadWeightSource(WeightSource):
            """vLLM's WeightSource over a streamload HubSource."""

            def __init__(self, inner: HubSource) -> None:
                self.inner = inner

            def metadata(self) -> list[Any]:
                return [VParamMeta(m.name, m.dtype, m.shape) for m in self.inner.metadata()]

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
                return iter(self.inner)

            def held_names(self) -> Collection[str] | None:
                return self.inner.held_names()

            def groups(self) -> list[list[str]]:
                return self.inner.groups()

            def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor | None]]]:
                return self.inner.iter_groups()

        _VLLM_CLASS.append(StreamloadWeightSource)
    return _VLLM_CLASS[0](source)
