"""sync_weights: the trainer's weights into colocated vLLM engines (one per trainer rank, verl's
hybrid engine), or into one engine in a process of its own (``remote.py``), after every step.
Collective over the trainer's group.

probe each engine (its config and ties; an engine that does not answer is dead) -> check that
its model takes the trainer's hub tensors (names, shapes) -> agree (every rank raises the same
named error) -> stream a HubSource (one collective per layer group) into each engine's
``reload_weights``, its tied aliases included -> agree on the outcome.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..model.placement import resolve_device, resolve_group
from ..save.layout import Layout, model_state, output_layout
from ..transport.arrival import lost_peer, meeting
from ..transport.protocol import carries_cpu, gather_or_raise
from .errors import EngineDeadError, EngineMismatchError, SyncError
from .remote import RemoteEngine
from .source import HubSource, SourceStats
from .vllm_engine import expected_hub_shapes, tie_aliases, worker_info, worker_reload


@dataclass
class SyncReport:
    """What one sync did, on this rank.

    Attributes:
        seconds: wall time of the whole sync.
        engine_seconds: time inside the engine's reload (the stream's production included).
        pack_seconds: sender-side assembly (zeroing and copies of own pieces).
        wire_seconds: time in the collectives.
        groups: layer groups sent (one collective each).
        bytes: group buffer bytes.
        peak_group_bytes: the largest group buffer (peak extra memory).
        held_groups: the most group buffers alive at once on this rank (CPU; 1: each group let go
            before the next was made; more: the engine still held an earlier group's tensors).
        aliases: engine names sent beside a hub tensor (the engine's ties).
        refreshed: MoE layers whose experts were re-packed after the reload.
        engine_rss: the engine process's resident bytes after the sync (a separate engine, as
            rank 0 heard it; 0 for colocated engines).
        kept_bytes: host memory this rank keeps for the next sync (one group buffer with
            ``keep_buffer``; 0 on a device, where torch's caching allocator keeps it).
        engine_held_groups: a separate engine's most group buffers alive at once in its process
            (0 for colocated engines).
        engine_kept_bytes: the group buffer a separate engine's process keeps for the next sync.
    """

    seconds: float = 0.0
    engine_seconds: float = 0.0
    pack_seconds: float = 0.0
    wire_seconds: float = 0.0
    groups: int = 0
    bytes: int = 0
    peak_group_bytes: int = 0
    held_groups: int = 0
    aliases: dict[str, list[str]] = field(default_factory=dict)
    refreshed: int = 0
    engine_rss: int = 0
    kept_bytes: int = 0
    engine_held_groups: int = 0
    engine_kept_bytes: int = 0


# model -> (what the source was planned for, the source): the plan (and its one agreement) is
# made once and reused by every later sync of the same model into the same kind of engine.
_SOURCES: weakref.WeakKeyDictionary[nn.Module, tuple[Any, HubSource]] = weakref.WeakKeyDictionary()


def sync_weights(
    model: nn.Module,
    llm: Any,
    *,
    dtype: torch.dtype | None = None,
    process_group: dist.ProcessGroup | None = None,
    device_mesh: Any = None,
    timeout: float | None = None,
    keep_buffer: bool = True,
) -> SyncReport:
    """Loads the trainer's current weights into this rank's colocated vLLM engine, or into an
    engine in another process (``llm`` a ``RemoteEngine``), in place.

    Every trainer rank calls it with its own engine (``vllm.LLM`` in this process; an in-process
    engine core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as verl's hybrid engine runs it). The
    weights travel in hub layout (the names and per-expert tensors ``save_pretrained`` writes),
    one layer group at a time with one collective each, straight into the engine's own
    ``reload_weights``; ties the engine keeps as separate layers get the tensor under each name.
    The synced engine equals a fresh engine loaded from ``save_pretrained`` of the same model.

    Args:
        model: the trainer's model (FSDP2 / DTensor, or plain).
        llm: this rank's engine (``vllm.LLM``), or a ``RemoteEngine`` (the same one engine on
            every rank, fed by one ``reduce`` per layer group over the link's transfer group).
        dtype: cast floating-point tensors on the way (the engine's dtype, e.g. bf16 masters ->
            bf16); None sends the trainer's dtypes.
        process_group: the trainer's group (default: ``device_mesh``'s, else the default group).
        device_mesh: the model's mesh.
        timeout: seconds to wait for peers that have not called (``STREAMLOAD_TIMEOUT``, 300),
            and at most for each per-group collective.
        keep_buffer: with a CPU wire (gloo), keep one group buffer resident until the next sync
            (``SyncReport.kept_bytes``) instead of faulting a fresh one in every sync; False
            frees it when the sync ends.

    Returns:
        SyncReport for this rank.

    Raises:
        EngineMismatchError: an engine's model does not take the trainer's tensors (names,
            shapes) - on every rank, before any weight moved.
        EngineDeadError: an engine did not answer (shut down, crashed) - on every rank.
        RankAbsentError: some ranks never called (after ``timeout``).
        RankLostError: a trainer rank died during the sync, or a collective did not complete
            within ``timeout`` (every survivor, naming the ranks gone).
        SyncError: the reload failed in some engine, or a rank failed to pack a layer group
            (every rank, naming the rank and tensor; the weights may be partial).

    Example:
        >>> for step in range(steps):
        ...     train_step(model)
        ...     streamload.sync_weights(model, llm)
        ...     rollouts = llm.generate(prompts, params)
    """
    group = resolve_group(process_group, device_mesh)
    with meeting("sync_weights", group, timeout, {"dtype": dtype}):
        return _sync(model, llm, dtype, group, device_mesh, keep_buffer)


def _sync(
    model: nn.Module, llm: Any, dtype: torch.dtype | None, group: Any, device_mesh: Any, keep_buffer: bool
) -> SyncReport:
    t0 = time.perf_counter()
    remote = llm if isinstance(llm, RemoteEngine) else None
    rank = dist.get_rank(group) if group is not None else 0
    device = (
        torch.device("cpu")
        if group is None or carries_cpu(group)
        else resolve_device(model, device_mesh, group)
    )
    local: BaseException | None = None
    aliases: dict[str, list[str]] = {}
    layout: Layout | None = None
    try:
        info = remote.probe() if remote is not None else _probe(llm, rank)
        layout = _layout(model, dtype)
        check_engine(layout, info["config"], rank)
        aliases = tie_aliases(info["ties"], layout.tensors)
    except BaseException as exc:  # noqa: BLE001 - agreed below: the same error on every rank
        local = exc
    every = gather_or_raise((aliases, _plan_current(model)), local, rank, group, device)
    if any(a[0] != every[0][0] for a in every):
        raise SyncError(
            f"the engines tie different weights (rank 0: {every[0][0]}, others: {[a[0] for a in every]})",
            hint="every trainer rank's engine must serve the same model",
        )
    assert layout is not None
    # agreed: a rank that replaced a parameter re-plans with all
    transfer = None if remote is None else (remote.pg, remote.engine_rank)
    source = _source(
        model, dtype, aliases, group, device_mesh, layout, transfer, reuse=all(a[1] for a in every)
    )
    source.watch = None if remote is None else remote.watch
    source.keep_buffer = keep_buffer
    if not keep_buffer:
        source.release()  # what an earlier sync kept
    before = SourceStats(**vars(source.stats))
    outcome, local = _feed_remote(remote, source) if remote is not None else _feed(llm, source, rank)
    every = gather_or_raise(outcome, local, rank, group, device)
    if remote is not None:
        outcome = every[0]  # the engine's answer, as rank 0 heard it
    outcome = outcome or {}
    s = source.stats
    return SyncReport(
        seconds=time.perf_counter() - t0,
        engine_seconds=float(outcome.get("seconds", 0.0)),
        pack_seconds=s.pack_seconds - before.pack_seconds,
        wire_seconds=s.wire_seconds - before.wire_seconds,
        groups=s.groups - before.groups,
        bytes=s.bytes - before.bytes,
        peak_group_bytes=source.largest_group_bytes,
        held_groups=s.held_groups,
        aliases=aliases,
        refreshed=int(outcome.get("refreshed", 0)),
        engine_rss=int(outcome.get("rss", 0)),
        kept_bytes=source.kept_bytes,
        engine_held_groups=int(outcome.get("held_groups", 0)),  # a separate engine's answer only
        engine_kept_bytes=int(outcome.get("kept", 0)),
    )


def _feed(llm: Any, source: HubSource, rank: int) -> tuple[dict[str, Any], BaseException | None]:
    """This rank's colocated engine reloads from a pass of ``source`` (one ``all_reduce`` per
    group); returns its outcome and this rank's error (None where a peer's is the one to agree on)."""
    outcome: dict[str, Any] = {}
    local: BaseException | None = None
    source.failed = source.peer_failed = None  # the last pass's, should this one never start
    weights = iter(source)
    try:
        outcome = llm.collective_rpc(worker_reload, args=(weights,))[0]
    except BaseException as exc:  # noqa: BLE001 - agreed by the caller
        local = exc
    if source.failed is not None:  # this rank failed to pack a group (whatever the engine made of it)
        return outcome, source.failed
    if source.peer_failed is not None:
        return outcome, None  # a peer failed to pack a group: the agreement carries its error
    if local is not None and not lost_peer(local):
        # The engine stopped pulling: the next group carries this rank's flag, which ends the
        # pass on every rank (no peer is left in a collective).
        source.abort(local)
        try:
            for _ in weights:
                pass
        except SyncError:
            pass
        except BaseException as exc:  # noqa: BLE001 - a peer lost while draining is the error now
            if lost_peer(exc):
                local = exc
    return outcome, _as_sync_error(local, rank)


def _feed_remote(
    remote: RemoteEngine, source: HubSource
) -> tuple[dict[str, Any] | None, BaseException | None]:
    """One ``reduce`` per group over the link's transfer group while the engine's worker
    reloads; returns the engine's answer (rank 0; None elsewhere) and this rank's error.

    A rank that fails to pack a group sends zeros (and its flag) to the end of the pass, so the
    engine and every peer finish it; the engine stops reloading at the flag. The engine's process
    gone mid-pass: every rank's wait notices it (``RemoteEngine.ping`` once a second)."""
    answer: dict[str, Any] | None = None
    local: BaseException | None = None
    try:
        remote.post({"op": "sync", "plan": remote.plan_for(source.planned_groups)})
        try:
            for _ in source.iter_groups():
                pass
        except SyncError as exc:
            if exc is not source.failed:
                raise
            local = exc
        answer = remote.answer()
        if answer is not None and not answer["ok"] and not answer.get("aborted") and local is None:
            local = SyncError(f"the engine's reload failed ({answer['error']})", rank=remote.rank)
    except SyncError as exc:
        local = exc
    except BaseException as exc:  # noqa: BLE001 - the engine gone, or a trainer peer (the meeting names it)
        local = exc if remote.alive() else remote.dead_error(exc)
    return answer, local


def _probe(llm: Any, rank: int) -> dict[str, Any]:
    """The engine's config and ties; an engine that cannot answer is dead."""
    try:
        replies = llm.collective_rpc(worker_info)
    except Exception as exc:  # noqa: BLE001 - any failure to answer means the engine is gone
        raise EngineDeadError(
            f"the inference engine did not answer ({type(exc).__name__}: {exc})",
            rank=rank,
            hint="restart the engine (vllm.LLM) on this rank before the next sync",
        ) from exc
    if not replies:
        raise EngineDeadError("the inference engine has no workers", rank=rank)
    return dict(replies[0])


def check_engine(layout: Layout, config: dict[str, Any], rank: int | None = None) -> None:
    """Raises EngineMismatchError unless the engine's model takes exactly the trainer's hub
    tensors (names and shapes, from the engine's own config).

    Example:
        >>> check_engine(output_layout(model), worker_info(worker)["config"])
    """
    want = expected_hub_shapes(config)
    have = {k: tuple(t.shape) for k, t in layout.tensors.items()}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    shapes = {k: (have[k], want[k]) for k in sorted(set(want) & set(have)) if have[k] != want[k]}
    if not (missing or unexpected or shapes):
        return
    parts = []
    if shapes:
        k, (a, b) = next(iter(shapes.items()))
        parts.append(f"{len(shapes)} shapes differ (first '{k}': trainer {list(a)}, engine {list(b)})")
    if missing:
        parts.append(f"{len(missing)} tensors the engine needs are not in the trainer (first '{missing[0]}')")
    if unexpected:
        parts.append(f"{len(unexpected)} trainer tensors the engine does not take (first '{unexpected[0]}')")
    raise EngineMismatchError(
        f"the engine's model ({config.get('model_type')}) does not match the trainer's: " + "; ".join(parts),
        tensor=next(iter(shapes), None) or (missing or unexpected)[0],
        rank=rank,
        missing=missing,
        unexpected=unexpected,
        shapes=shapes,
        hint="start the engine from the checkpoint the trainer was loaded from (same config)",
    )


def _source(
    model: nn.Module,
    dtype: torch.dtype | None,
    aliases: dict[str, list[str]],
    group: Any,
    device_mesh: Any,
    layout: Layout,
    transfer: tuple[Any, int] | None = None,
    reuse: bool = True,
) -> HubSource:
    key = (dtype, sorted((k, tuple(v)) for k, v in aliases.items()), id(group), id(transfer and transfer[0]))
    cached = _SOURCES.get(model)
    if reuse and cached is not None and cached[0] == key:
        return cached[1]
    source = HubSource(
        model,
        dtype=dtype,
        process_group=group,
        device_mesh=device_mesh,
        aliases=aliases,
        layout=layout,
        transfer=transfer,
    )
    _SOURCES[model] = (key, source)
    return source


def _layout(model: nn.Module, dtype: torch.dtype | None) -> Layout:
    """The hub layout of ``model``: the cached plan's while it still holds the model's own tensors
    in the same dtype (planning a per-expert MoE layout runs transformers' reverse conversion on
    meta tensors of every parameter: tenths of a second a sync), else planned afresh."""
    cached = _SOURCES.get(model)
    if cached is not None and cached[0][0] == dtype and _plan_current(model):
        return cached[1].layout
    return output_layout(model, dtype=dtype)


def _plan_current(model: nn.Module) -> bool:
    """Whether the cached plan still holds the model's own tensors: a parameter or buffer replaced
    since (``load_state_dict(assign=True)`` on resume, a re-``fully_shard``) would be read stale."""
    cached = _SOURCES.get(model)
    if cached is None:
        return False
    now = model_state(model)
    return all(now.get(name) is t for name, t in cached[1].plan.tensors.items())


def _as_sync_error(exc: BaseException | None, rank: int) -> BaseException | None:
    if exc is None or isinstance(exc, (SyncError, KeyboardInterrupt)) or lost_peer(exc):
        return exc
    dead = "dead" in type(exc).__name__.lower() or "shut" in str(exc).lower()
    cls = EngineDeadError if dead else SyncError
    err = cls(f"the engine's reload failed ({type(exc).__name__}: {exc})", rank=rank)
    err.__cause__ = exc
    return err
