"""load_checkpoint: checkpoint -> plan -> pack -> transport -> unpack -> finalize."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dist.protocol import gather_or_raise, portable
from ..dist.readers import ReaderChoice, choose
from ..dist.stream import read_owned, scatter
from ..dist.transport import broadcast_object
from ..errors import CheckpointError, KeyMismatchError, StreamloadError
from ..io._native import default_threads
from ..io.checkpoint import Checkpoint
from ..io.sources import Source, as_source
from ..model.mapped import MappedShards, map_shards
from ..model.state import (
    ModelState,
    ignore_patterns,
    is_meta,
    local_placement,
    local_tensor,
    materialize,
    rebind_ties,
    record_state,
    restore_buffers,
)
from ..plan.buckets import Placement, build_plan, validate_dtypes, validate_shapes
from ..plan.convert import FALLBACK_PREFIX, FallbackSources, plan_conversions
from ..plan.keys import Table, match_keys
from ..report import LoadReport

log = logging.getLogger("streamload")

# Measured on CPU/gloo (benchmarks/bench_memory.py): 64 MiB buckets load as
# fast as 256 MiB ones with a quarter of the staging memory. NCCL links want
# larger messages to reach bandwidth.
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_CPU_BUCKET_BYTES = 64 << 20


def default_bucket_bytes(device: torch.device) -> int:
    """Bytes per bucket when the caller does not say: 64 MiB on CPU, 256 MiB on GPUs."""
    return DEFAULT_CPU_BUCKET_BYTES if device.type == "cpu" else DEFAULT_BUCKET_BYTES


# readers="owners" on the CPU copies straight into the shards (nothing is
# staged): buckets only pace the per-bucket error check.
OWNERS_CPU_BUCKET_BYTES = 1 << 30

# Tied duplicates are compared this many bytes at a time: never a full copy.
_COMPARE_CHUNK = 64 << 20


@dataclass
class SourceMeta:
    """What the reader tells every rank before any weight moves."""

    table: Table
    tie_conflicts: list[str] = field(default_factory=list)
    path: str | None = None  # the checkpoint as the reader names it
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. config for from_pretrained


def resolve_group(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup | None:
    """The group to load over: given, else the default one; None without torch.distributed."""
    if process_group is not None:
        return process_group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if device_mesh is not None:
        if device_mesh.ndim == 1:
            return device_mesh.get_group()
        if device_mesh.size() != dist.get_world_size():
            # An N-d mesh over part of the world: its flattened group spans it.
            return device_mesh._flatten().get_group()
    return dist.group.WORLD


def resolve_device(model: nn.Module, device_mesh: Any, group: dist.ProcessGroup | None) -> torch.device:
    """The device local shards live on: the mesh's, else the model's, else by backend."""
    dev_type = getattr(device_mesh, "device_type", None)
    if dev_type is None:
        for p in model.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                dev_type = mesh.device_type
                break
            if not p.is_meta:
                return p.device
    if dev_type is None:
        backend = dist.get_backend(group) if group is not None else "gloo"
        dev_type = "cuda" if "nccl" in str(backend) else "cpu"
    if dev_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(dev_type)


def _compare_tied(ckpt: Source, state: ModelState) -> list[str]:
    """Aliases whose checkpoint bytes differ from their canonical tensor's."""
    conflicts = []
    for g in state.ties:
        for alias in g.aliases:
            if g.canonical not in ckpt or alias not in ckpt:
                continue
            a, b = ckpt.info(g.canonical), ckpt.info(alias)
            if a.shape != b.shape or a.dtype != b.dtype:
                conflicts.append(alias)
                continue
            rows = max(1, _COMPARE_CHUNK // max(1, a.nbytes // max(1, a.shape[0] if a.shape else 1)))
            n0 = a.shape[0] if a.shape else 1
            for r in range(0, n0, rows):
                box = [(r, min(r + rows, n0))] + [(0, s) for s in a.shape[1:]] if a.shape else []
                if not torch.equal(
                    ckpt.read_region(g.canonical, box).view(torch.uint8),
                    ckpt.read_region(alias, box).view(torch.uint8),
                ):
                    conflicts.append(alias)
                    break
    return conflicts


def open_source(
    path: Any,
    rank: int,
    src_rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    state: ModelState,
    read_mode: str = "auto",
    threads: int | None = None,
    extra: Any = None,
) -> tuple[Source | None, SourceMeta]:
    """The reader opens the checkpoint and broadcasts its table (or its error)."""
    ckpt: Source | None = None
    payload: SourceMeta | BaseException | None = None
    local: BaseException | None = None
    if rank == src_rank:
        try:
            if path is None:
                raise StreamloadError("the reader rank was given no checkpoint", rank=rank)
            ckpt = as_source(path, read_mode, threads)
            table = {t.name: (t.dtype, t.shape, t.file) for t in ckpt.tensors}
            payload = SourceMeta(
                table,
                tie_conflicts=_compare_tied(ckpt, state),
                path=str(getattr(ckpt, "path", path)),
                extra=dict(extra() if callable(extra) else extra or {}),
            )
        except BaseException as exc:  # noqa: BLE001 - every rank must hear of it
            local = exc
            payload = portable(exc, rank)
    payload = broadcast_object(
        payload, src_rank, group, device if device.type != "meta" else torch.device("cpu")
    )
    if local is not None:
        raise local
    if isinstance(payload, BaseException):
        raise payload
    assert isinstance(payload, SourceMeta)
    return ckpt, payload


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike | Checkpoint | Mapping[str, torch.Tensor] | None,
    *,
    src_rank: int = 0,
    strict: bool = True,
    bucket_bytes: int | None = None,
    slots: int = 2,
    progress: bool | None = None,
    process_group: dist.ProcessGroup | None = None,
    device_mesh: Any = None,
    threads: int | None = None,
    read_mode: str = "auto",
    readers: str = "auto",
    map_files: bool = True,
    _source: tuple[Source | None, SourceMeta] | None = None,
) -> LoadReport:
    """Streams a safetensors checkpoint into an FSDP2 (or plain) model.

    Only ``src_rank`` opens ``path``; other ranks receive the tensor table
    and then only their own shards' bytes. Meta models are materialised on
    the mesh's device first; ties are re-bound and non-persistent buffers
    restored afterwards.

    Args:
        model: a model, ``fully_shard``-ed or not, on meta or materialised.
        path: checkpoint file or directory, an open Checkpoint, or a dict of
            tensors (used on ``src_rank`` only; other ranks may pass anything,
            even a path that does not exist there, or None).
        src_rank: the global rank that reads.
        strict: raise KeyMismatchError on missing/unexpected keys (all ranks,
            before any weight is sent); else report them.
        bucket_bytes: bytes per collective, all ranks together (default:
            64 MiB on CPU, 256 MiB on GPUs).
        slots: staging slots (>= 2 overlaps packing with transport).
        progress: tqdm bar on ``src_rank`` (default: when stderr is a TTY;
            STREAMLOAD_PROGRESS=0/1 overrides).
        process_group: group to load over (default: the default group).
        device_mesh: the mesh the model is sharded on (for the device type).
        threads: native copy threads on the reader.
        read_mode: "auto", "mmap" or "pread".
        readers: who reads: "src" (``src_rank`` reads and scatters), "owners"
            (every rank reads its own shards, no transport), "node" (one
            reader per node scatters within its node), or "auto" (the
            default: owners when every rank sees the same files, node when
            each node has a rank that does, else src). The choice and the
            reason are in ``LoadReport.reader``.
        map_files: on the CPU, a shard this rank reads itself that is one
            contiguous run of one checkpoint tensor in the parameter's dtype
            becomes a copy-on-write view of the file (as safetensors gives
            CPU tensors) rather than a copy; the file is never written.
            False: private copies (choose it if the files may be rewritten
            in place while the model lives).

    Returns:
        A LoadReport.

    Example:
        >>> model = AutoModelForCausalLM.from_config(cfg)  # under torch.device("meta")
        >>> for layer in model.model.layers: fully_shard(layer)
        >>> fully_shard(model)
        >>> report = streamload.load_checkpoint(model, "/ckpt")
    """
    t0 = time.perf_counter()
    if slots < 1:
        raise ValueError("slots must be >= 1")
    group = resolve_group(process_group, device_mesh)
    rank = dist.get_rank() if group is not None else 0
    device = resolve_device(model, device_mesh, group)
    bucket_bytes = bucket_bytes or default_bucket_bytes(device)
    phases: dict[str, float] = {}
    mark = [time.perf_counter()]

    def phase(name: str) -> None:
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - mark[0]
        mark[0] = now

    state = record_state(model)
    ckpt, meta = _source or open_source(path, rank, src_rank, group, device, state, read_mode, threads)
    table = meta.table
    src_group_rank = dist.get_group_rank(group, src_rank) if group is not None else 0
    group_rank = dist.get_group_rank(group, rank) if group is not None else 0
    in_memory = rank == src_rank and (ckpt is not None and not isinstance(path, (str, os.PathLike)))
    choice = choose(readers, path, src_group_rank, group, device, in_memory)
    if group_rank == src_group_rank:
        log.info("streamload: readers=%s (%s)", choice.mode, choice.reason)
    phase("open")

    # Every check that can be made before the first weight byte is made here;
    # any rank's failure reaches all ranks through the placement all-gather.
    local_error: BaseException | None = None
    mine: list[Placement] = []
    match = None
    conversion = None
    unrestored: list[str] = []
    tensors: list[torch.Tensor] = []
    try:
        shapes = {name: tuple(t.shape) for name, t in state.targets().items()}
        conversion = plan_conversions(model, table, shapes)
        table = {**table, **conversion.virtual_table}
        match = match_keys(state, shapes, table, *ignore_patterns(model), conversion)
        if strict and (match.missing or match.unexpected):
            raise KeyMismatchError(
                f"{len(match.missing)} missing keys {match.missing[:20]}, "
                f"{len(match.unexpected)} unexpected keys {match.unexpected[:20]}",
                file=meta.path,
                rank=rank,
                missing=match.missing,
                unexpected=match.unexpected,
            )
        # Shapes and tilings need no allocation: check them before materialising.
        validate_shapes(match.targets, table)
        phase("match")
        if is_meta(model):
            materialize(model, device)
            unrestored = restore_buffers(model, state)
        rebind_ties(model, state.ties)
        phase("materialize")
        tensors = [_lookup(model, t.name) for t in match.targets]
        mine = [local_placement(t) for t in tensors]
        reads = choice.mode == "owners" or (choice.mode == "node" and group_rank in choice.node_readers)
        if reads and ckpt is None:
            if threads is None and choice.mode == "owners" and choice.nodes:
                # Ranks of a node read at once: share its cores rather than oversubscribe them.
                local = next(len(ranks) for ranks in choice.nodes if group_rank in ranks)
                threads = max(1, default_threads() // local)
            ckpt = as_source(path, read_mode, threads)
            _check_same_table(ckpt, meta.table)
    except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        local_error = exc
    placements = gather_or_raise(mine, local_error, rank, group, device)
    assert match is not None and conversion is not None
    validate_dtypes(match.targets, table, placements)
    if choice.mode == "owners" and device.type == "cpu":
        # Every rank fills its shards in place: no staging, no wire. A bucket is
        # then only the stride of the error check, and a coarse one costs less.
        bucket_bytes = max(bucket_bytes, OWNERS_CPU_BUCKET_BYTES)
    plan = build_plan(match.targets, {k: v[0] for k, v in table.items()}, placements, bucket_bytes)

    if rank == src_rank and meta.tie_conflicts:
        warnings.warn(
            f"streamload: checkpoint holds tied tensors with different values: {meta.tie_conflicts}; "
            "the canonical tensor is loaded and the alias ignored (as transformers does)",
            stacklevel=2,
        )
    locals_ = [local_tensor(t) for t in tensors]
    mapped = MappedShards()
    if map_files and device.type == "cpu" and isinstance(ckpt, Checkpoint) and mine:
        if group_rank in _reader_ranks(choice, src_group_rank, plan.world_size):
            mapped = map_shards(plan.targets, [p.box for p in mine], tensors, locals_, ckpt, model)
    phase("plan")
    fallbacks = FallbackSources(conversion, ckpt, model) if ckpt is not None else None
    if choice.mode == "owners":
        peak, bytes_read = read_owned(
            plan, group_rank, group, device, ckpt, locals_, fallbacks, slots, progress, mapped.targets
        )
    elif choice.mode == "node":
        assert group is not None
        node = next(i for i, ranks in enumerate(choice.nodes) if group_rank in ranks)
        node_groups = [
            dist.new_group([dist.get_global_rank(group, r) for r in ranks]) for ranks in choice.nodes
        ]
        node_ranks = choice.nodes[node]
        reader = choice.node_readers[node]
        node_plan = build_plan(
            match.targets,
            {k: v[0] for k, v in table.items()},
            [placements[r] for r in node_ranks],
            bucket_bytes,
        )
        failure: BaseException | None = None
        peak, bytes_read = 0, 0
        try:
            peak, bytes_read = scatter(
                node_plan,
                node_ranks.index(group_rank),
                node_ranks.index(reader),
                dist.get_global_rank(group, reader),
                node_groups[node],
                device,
                ckpt if group_rank == reader else None,
                locals_,
                fallbacks,
                slots,
                progress,
                mapped.targets,
            )
        except BaseException as exc:  # noqa: BLE001 - other nodes must hear of it too
            failure = exc
        gather_or_raise(None, failure, rank, group, device)  # nothing else crossed between nodes
    else:
        peak, bytes_read = scatter(
            plan,
            group_rank,
            src_group_rank,
            src_rank,
            group,
            device,
            ckpt if rank == src_rank else None,
            locals_,
            fallbacks,
            slots,
            progress,
            mapped.targets,
        )

    phase("stream")
    rebind_ties(model, state.ties)
    phase("finalize")
    seconds = time.perf_counter() - t0
    received = [0] * plan.world_size
    for b in plan.buckets:
        for r, segs in enumerate(b.segments):
            received[r] += sum(s.nbytes for s in segs)
    readers_at = _reader_ranks(choice, src_group_rank, len(received))
    if group_rank == src_group_rank:
        log.info(
            "streamload: %.2f GB in %.2f s (%d buckets; this rank read %.2f GB, mapped %.2f GB)",
            plan.payload_bytes / 1e9,
            seconds,
            len(plan.buckets),
            bytes_read / 1e9,
            mapped.nbytes / 1e9,
        )
    return LoadReport(
        bytes_read=bytes_read,
        bytes_mapped=mapped.nbytes,
        bytes_sent=sum(n for r, n in enumerate(received) if r not in readers_at),
        payload_bytes=plan.payload_bytes,
        seconds=seconds,
        gbps=plan.payload_bytes / seconds / 1e9 if seconds > 0 else 0.0,
        buckets=len(plan.buckets),
        bucket_bytes=bucket_bytes,
        slots=slots,
        peak_staging_bytes=peak,
        bytes_received=received,
        missing_keys=match.missing,
        unexpected_keys=match.unexpected,
        tie_groups=[[g.canonical, *g.aliases] for g in state.ties],
        tie_conflicts=meta.tie_conflicts,
        converted=match.converted,
        unrestored_buffers=unrestored,
        reader=f"{choice.mode}: {choice.reason}",
        phases=phases,
    )


def _reader_ranks(choice: ReaderChoice, src: int, world: int) -> set[int]:
    if choice.mode == "owners":
        return set(range(world))
    if choice.mode == "node":
        return set(choice.node_readers)
    return {src}


def _check_same_table(ckpt: Source, table: Table) -> None:
    """A rank reading on its own must see the reader's tensor table exactly."""
    mine = {t.name: (t.dtype, tuple(t.shape)) for t in ckpt.tensors}
    theirs = {k: (v[0], tuple(v[1])) for k, v in table.items() if not k.startswith(FALLBACK_PREFIX)}
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:5]
        raise CheckpointError(
            f"this rank's checkpoint differs from the reader's: {diff}", str(getattr(ckpt, "path", ""))
        )


def _lookup(model: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    t: torch.Tensor | None = mod._parameters.get(attr)
    if t is None:
        t = mod._buffers[attr]
    assert t is not None
    return t
