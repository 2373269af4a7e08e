"""Prepare: open, match, validate, materialise, agree on placements and plan, before any weight moves."""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dist.protocol import gather_or_raise
from ..dist.readers import ReaderChoice, ReaderMode, choose
from ..dist.stream import Shards
from ..errors import KeyMismatchError
from ..io._native import default_threads
from ..io.checkpoint import Checkpoint
from ..io.sources import Source, as_source
from ..model.mapped import MappedShards, map_shards
from ..model.state import (
    ModelState,
    get_tensor,
    ignore_patterns,
    is_meta,
    local_placement,
    local_tensor,
    materialize,
    rebind_ties,
    record_state,
    restore_buffers,
)
from ..plan.buckets import Placement, Plan, build_plan, validate_dtypes, validate_shapes
from ..plan.convert import Conversion, FallbackSources, Table, plan_conversions
from ..plan.keys import KeyMatch, match_keys
from .source import OpenedSource, SourceMeta, check_same_table, open_source, resolve_device, resolve_group

log = logging.getLogger("streamload")

# Measured on CPU/gloo (benchmarks/bench_memory.py): 64 MiB buckets load as
# fast as 256 MiB ones with a quarter of the staging memory. NCCL links want
# larger messages to reach bandwidth.
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_CPU_BUCKET_BYTES = 64 << 20

# readers="owners" on the CPU copies straight into the shards (nothing is
# staged): buckets only pace the per-bucket error check.
OWNERS_CPU_BUCKET_BYTES = 1 << 30


def default_bucket_bytes(device: torch.device) -> int:
    """Bytes per bucket when the caller does not say: 64 MiB on CPU, 256 MiB on GPUs."""
    return DEFAULT_CPU_BUCKET_BYTES if device.type == "cpu" else DEFAULT_BUCKET_BYTES


@dataclass
class LoadOptions:
    """The knobs of one load; ``load_checkpoint`` documents each."""

    src_rank: int = 0
    strict: bool = True
    bucket_bytes: int | None = None
    slots: int = 2
    progress: bool | None = None
    process_group: dist.ProcessGroup | None = None
    device_mesh: Any = None
    threads: int | None = None
    read_mode: str = "auto"
    drop_cache: bool = False
    readers: str | ReaderMode = ReaderMode.AUTO
    map_files: bool = True


class PhaseClock:
    """Seconds per named phase of a load, from one start."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """Charges the time since the previous mark to ``name``."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now


@dataclass
class Prepared:
    """Everything a reader strategy needs to run the plan, and finalize to report on it."""

    model: nn.Module
    options: LoadOptions
    clock: PhaseClock
    state: ModelState
    group: dist.ProcessGroup | None
    device: torch.device
    rank: int  # global
    group_rank: int
    src_group_rank: int
    choice: ReaderChoice
    meta: SourceMeta
    source: Source | None  # this rank's open checkpoint, where it reads
    match: KeyMatch
    table: Table  # the reader's table plus the conversions' virtual entries
    placements: list[list[Placement]]  # every rank's, in group-rank order
    plan: Plan
    bucket_bytes: int
    shards: Shards
    mapped: MappedShards
    unrestored: list[str] = field(default_factory=list)


@dataclass
class _Local:
    """What each rank checks and builds on its own before the placement all-gather."""

    conversion: Conversion | None = None
    match: KeyMatch | None = None
    table: Table = field(default_factory=dict)
    unrestored: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    mine: list[Placement] = field(default_factory=list)
    source: Source | None = None


def prepare(
    model: nn.Module, path: Any, options: LoadOptions, opened: OpenedSource | None = None
) -> Prepared:
    """Collective: every check that can be made before the first weight byte, then the plan.

    Any rank's failure reaches all ranks through the placement all-gather.

    Args:
        model: the model to fill (``fully_shard``-ed or not, meta or materialised).
        path: what this rank was given (see ``load_checkpoint``).
        options: the load's knobs.
        opened: a checkpoint already opened with ``open_source`` (else it is opened here).

    Returns:
        The prepared load: materialised model, agreed placements, plan and local shards.
    """
    clock = PhaseClock()
    if options.slots < 1:
        raise ValueError("slots must be >= 1")
    group = resolve_group(options.process_group, options.device_mesh)
    rank = dist.get_rank() if group is not None else 0
    device = resolve_device(model, options.device_mesh, group)
    state = record_state(model)
    src_rank = options.src_rank
    if opened is None:
        opened = open_source(
            path,
            rank,
            src_rank,
            group,
            device,
            state,
            options.read_mode,
            options.threads,
            drop_cache=options.drop_cache,
        )
    meta = opened.meta
    src_group_rank = dist.get_group_rank(group, src_rank) if group is not None else 0
    group_rank = dist.get_group_rank(group, rank) if group is not None else 0
    in_memory = rank == src_rank and opened.source is not None and not isinstance(path, (str, os.PathLike))
    choice = choose(options.readers, path, src_group_rank, group, device, in_memory)
    if group_rank == src_group_rank:
        log.info("streamload: readers=%s (%s)", choice.mode.value, choice.reason)
    clock.mark("open")

    local = _Local(table=meta.table, source=opened.source)
    error: BaseException | None = None
    try:
        _check_and_materialize(
            model, path, options, state, meta, choice, rank, group_rank, device, local, clock
        )
    except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        error = exc
    placements = gather_or_raise(local.mine, error, rank, group, device)
    assert local.match is not None and local.conversion is not None
    validate_dtypes(local.match.targets, local.table, placements)
    bucket_bytes = options.bucket_bytes or default_bucket_bytes(device)
    if choice.mode is ReaderMode.OWNERS and device.type == "cpu":
        # Every rank fills its shards in place: no staging, no wire. A bucket is
        # then only the stride of the error check, and a coarse one costs less.
        bucket_bytes = max(bucket_bytes, OWNERS_CPU_BUCKET_BYTES)
    dtypes = {k: v[0] for k, v in local.table.items()}
    plan = build_plan(local.match.targets, dtypes, placements, bucket_bytes)
    if rank == src_rank and meta.tie_conflicts:
        warnings.warn(
            f"streamload: checkpoint holds tied tensors with different values: {meta.tie_conflicts}; "
            "the canonical tensor is loaded and the alias ignored (as transformers does)",
            stacklevel=4,
        )
    locals_ = [local_tensor(t) for t in local.tensors]
    mapped = MappedShards()
    ckpt = local.source
    if options.map_files and device.type == "cpu" and isinstance(ckpt, Checkpoint) and local.mine:
        if group_rank in choice.reader_ranks(src_group_rank, plan.world_size):
            mapped = map_shards(
                plan.targets, [p.box for p in local.mine], local.tensors, locals_, ckpt, model
            )
            if mapped.ranges and ckpt.read_mode == "cold":
                # Views of cold files would fault page by page at first touch: read them in now.
                ckpt.engine.prefetch(mapped.ranges)
    clock.mark("plan")
    fallbacks = FallbackSources(local.conversion, ckpt, model) if ckpt is not None else None
    shards = Shards(locals_, fallbacks, options.slots, options.progress, mapped.targets)
    return Prepared(
        model, options, clock, state, group, device, rank, group_rank, src_group_rank, choice, meta, ckpt,
        local.match, local.table, placements, plan, bucket_bytes, shards, mapped, local.unrestored,
    )  # fmt: skip


def _check_and_materialize(
    model: nn.Module,
    path: Any,
    options: LoadOptions,
    state: ModelState,
    meta: SourceMeta,
    choice: ReaderChoice,
    rank: int,
    group_rank: int,
    device: torch.device,
    local: _Local,
    clock: PhaseClock,
) -> None:
    """This rank's share of the pre-stream checks, filling ``local`` as it goes."""
    shapes = {name: tuple(t.shape) for name, t in state.targets().items()}
    local.conversion = plan_conversions(model, meta.table, shapes)
    local.table = {**meta.table, **local.conversion.virtual_table}
    match = local.match = match_keys(state, shapes, local.table, *ignore_patterns(model), local.conversion)
    if options.strict and (match.missing or match.unexpected):
        raise KeyMismatchError(
            f"{len(match.missing)} missing keys {match.missing[:20]}, "
            f"{len(match.unexpected)} unexpected keys {match.unexpected[:20]}",
            file=meta.path,
            rank=rank,
            missing=match.missing,
            unexpected=match.unexpected,
        )
    # Shapes and tilings need no allocation: check them before materialising.
    validate_shapes(match.targets, local.table)
    clock.mark("match")
    if is_meta(model):
        materialize(model, device)
        local.unrestored = restore_buffers(model, state)
    rebind_ties(model, state.ties)
    clock.mark("materialize")
    local.tensors = [get_tensor(model, t.name) for t in match.targets]
    local.mine = [local_placement(t) for t in local.tensors]
    mode = choice.mode
    reads = mode is ReaderMode.OWNERS or (mode is ReaderMode.NODE and group_rank in choice.node_readers)
    if reads and local.source is None:
        threads = options.threads
        if threads is None and mode is ReaderMode.OWNERS and choice.nodes:
            # Ranks of a node read at once: share its cores rather than oversubscribe them.
            on_node = next(len(ranks) for ranks in choice.nodes if group_rank in ranks)
            threads = max(1, default_threads() // on_node)
        local.source = as_source(path, options.read_mode, threads, options.drop_cache)
        check_same_table(local.source, meta.table)
