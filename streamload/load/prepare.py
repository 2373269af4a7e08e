"""Prepare: open, match, validate, materialise, agree on placements and plan, before any weight moves."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import KeyMismatchError, PlacementError, key_mismatch_hint, key_mismatch_reason
from ..io.checkpoint import Checkpoint
from ..io.copy_ops import worker_threads
from ..io.remote import RemotePath, as_remote
from ..io.sources import Source, as_source
from ..model.fsdp_ties import TieLayout, agree_ties, tie_layout
from ..model.layouts import check_placements
from ..model.mapped import MappedShards, map_shards
from ..model.missing import fill_uncovered, snapshot_real
from ..model.offload import host_targets, materialize_offloaded, offloads_to_cpu
from ..model.own_buffers import init_own_buffers, unwritten_is_loud
from ..model.placement import resolve_device, resolve_group
from ..model.specs import (
    LayoutSpec,
    global_layout,
    layout_specs,
    placement_for,
    placements_for,
    spec_digest,
)
from ..model.state import (
    ModelState,
    check_fsdp_device,
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
from ..options import env_flag
from ..plan.buckets import Bucket, Placement, Plan, build_plan, validate_dtypes, validate_shapes
from ..plan.convert import Conversion, FallbackSources, Table, plan_conversions
from ..plan.global_buckets import build_served_plan
from ..plan.keys import KeyMatch, match_keys
from ..plan.mapping import plan_mapping
from ..plan.quant import QuantTensor, check_kept, quantized_view, scheme_from_config
from ..timeline import PhaseClock
from ..transport.protocol import gather_or_raise
from ..transport.readers import ReaderChoice, ReaderMode, choose, fall_back, opened_identity
from ..transport.strategies import ReaderStrategy, make_strategy
from ..transport.stream import Shards
from .source import OpenedSource, SourceMeta, check_same_table, open_source

log = logging.getLogger("streamload")

# Measured on CPU/gloo (benchmarks/bench_memory.py): 64 MiB buckets load as
# fast as 256 MiB ones with a quarter of the staging memory. NCCL links want
# larger messages to reach bandwidth.
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_CPU_BUCKET_BYTES = 64 << 20

# readers="owners" on the CPU copies straight into the shards (nothing is
# staged): buckets only pace the per-bucket error check.
OWNERS_CPU_BUCKET_BYTES = 1 << 30

# What to do with checkpoint tensors the model does not hold (see load_checkpoint).
UNEXPECTED_CHOICES = ("error", "ignore")


MAP_FILES = (True, False, "auto")


def mapping_policy(map_files: bool | str, tensors: list[torch.Tensor]) -> Callable[[int], bool]:
    """Which targets may become mapped views: all (True) or, under "auto", those
    no optimizer writes (``requires_grad=False``: frozen weights, buffers) - and
    under "auto" only from files this process cannot write (``map_shards``'
    ``copy_writable``: a save into the checkpoint would change mapped weights).

    Why "auto" copies trainable parameters: the first in-place update of a
    mapped page is a copy-on-write fault, and load plus first step measured
    slower mapped than copied on one rank (see the README's first-step column).
    """
    if map_files is True:
        return lambda i: True
    return lambda i: not tensors[i].requires_grad


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
    map_files: bool | str = "auto"
    quantized: str = "dequantize"
    unexpected: str = "error"
    mapping: Any = None
    direct_io: bool | None = None
    prefault: bool | None = None
    node: str | None = None
    storage_options: dict[str, Any] | None = None
    timeout: float | None = None

    def agreed(self) -> dict[str, Any]:
        """The options every rank of the load must pass alike (checked when the ranks meet)."""
        return {
            k: getattr(self, k)
            for k in ("src_rank", "strict", "bucket_bytes", "slots", "readers", "quantized", "unexpected")
        }


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
    placements: list[list[Placement]]  # the served ranks', in ``served`` order (``src``: this rank's own)
    plan: Plan  # over the served ranks: row i is group rank served[i]
    bucket_bytes: int
    shards: Shards
    mapped: MappedShards
    unrestored: list[str] = field(default_factory=list)
    served: list[int] = field(default_factory=list)  # group ranks the plan covers (see served_ranks)
    strategy: ReaderStrategy | None = None  # set once every rank agreed the load can start

    @property
    def plan_rank(self) -> int:
        """This rank's row in the plan."""
        return self.served.index(self.group_rank)


@dataclass
class _Local:
    """What each rank checks and builds on its own before the placement all-gather."""

    conversion: Conversion | None = None
    match: KeyMatch | None = None
    table: Table = field(default_factory=dict)
    unrestored: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    mine: list[Placement] = field(default_factory=list)
    specs: list[LayoutSpec] = field(default_factory=list)
    digest: str = ""
    source: Source | None = None
    quant: dict[str, QuantTensor] = field(default_factory=dict)
    replaced: bool = False  # the files this rank opened are not those auto's choice rests on


def served_ranks(choice: ReaderChoice, group_rank: int, world: int, src: int | None = None) -> list[int]:
    """The group ranks this rank plans for: its node's, itself (``owners``, a ``src`` receiver),
    or every rank (the ``src`` reader, group rank ``src``; every rank when ``src`` is None).

    A rank's planning cost is then its targets times these ranks, never times the world
    size except on the ``src`` reader, which does serve every rank.
    """
    if choice.mode is ReaderMode.OWNERS:
        return [group_rank]
    if choice.mode is ReaderMode.NODE:
        return list(next(ranks for ranks in choice.nodes if group_rank in ranks))
    if src is not None and group_rank != src:
        return [group_rank]
    return list(range(world))


def pad_buckets(plan: Plan, count: int) -> None:
    """Pads ``plan`` with empty buckets to ``count``, the most any rank has (agreed in ``prepare``)."""
    while len(plan.buckets) < count:
        plan.buckets.append(Bucket([[] for _ in range(plan.world_size)], [0] * plan.world_size))


def prepare(
    model: nn.Module,
    path: Any,
    options: LoadOptions,
    opened: OpenedSource | None = None,
    clock: PhaseClock | None = None,
) -> Prepared:
    """Collective: every check that can be made before the first weight byte, then the plan.

    Any rank's failure reaches all ranks: checks and materialisation through the
    digest all-gather, planning, mapping and the strategy's groups through a
    second agreement; nothing that can fail on one rank runs after it.

    Args:
        model: the model to fill (``fully_shard``-ed or not, meta or materialised).
        path: what this rank was given (see ``load_checkpoint``).
        options: the load's knobs.
        opened: a checkpoint already opened with ``open_source`` (else it is opened here).
        clock: the load's phase clock, when the caller started timing before (``from_pretrained``).

    Returns:
        The prepared load: materialised model, agreed placements, plan, local shards and the
        reader strategy, opened (the caller runs it and closes it).
    """
    clock = clock or PhaseClock()
    path = as_remote(path, options.storage_options)
    if options.slots < 1:
        raise ValueError("slots must be >= 1")
    if options.unexpected not in UNEXPECTED_CHOICES:
        raise ValueError(f"unexpected must be one of {UNEXPECTED_CHOICES}, not {options.unexpected!r}")
    if options.map_files not in MAP_FILES or not isinstance(options.map_files, (bool, str)):
        raise ValueError(f"map_files must be one of {MAP_FILES}, not {options.map_files!r}")
    group = resolve_group(options.process_group, options.device_mesh)
    rank = dist.get_rank() if group is not None else 0
    device = resolve_device(model, options.device_mesh, group)
    early: BaseException | None = None
    try:
        state = record_state(model)
        # As the caller sharded it: materialising and re-binding below would hide an untied alias.
        ties_here = tie_layout(model, state.ties)
    except BaseException as exc:  # noqa: BLE001 - raised in the first agreement below
        # This rank still opens and chooses with the others (collectives), with nothing to load.
        early, state, ties_here = exc, ModelState({}, {}, []), TieLayout("")
    clock.mark("state")
    src_rank = options.src_rank
    if group is not None and src_rank not in (members := dist.get_process_group_ranks(group)):
        # Every rank of the group decides alike, before any collective (torch's own error would
        # be a ValueError out of the first broadcast).
        raise PlacementError(
            f"src_rank={src_rank} is not a rank of the load's group (global ranks {sorted(members)}): "
            f"pass src_rank={min(members)}, the group's first rank, or a group that holds rank {src_rank}"
        )
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
            direct_io=options.direct_io,
            clock=clock,
            ask_identity=options.readers != "src",
        )
    meta = opened.meta
    src_group_rank = dist.get_group_rank(group, src_rank) if group is not None else 0
    group_rank = dist.get_group_rank(group, rank) if group is not None else 0
    in_memory = (
        rank == src_rank
        and opened.source is not None
        and not isinstance(path, (str, os.PathLike, RemotePath))
    )
    clock.mark("open")
    # The reader's identity comes from the files it opened above, whatever their paths name by now.
    source = opened.source
    choice = choose(
        options.readers,
        path,
        src_group_rank,
        group,
        device,
        in_memory,
        node=options.node,
        source=source,
        identity=opened.identity,
    )
    if group_rank == src_group_rank:
        log.info("streamload: readers=%s (%s)", choice.mode.value, choice.reason)
    clock.mark("readers")  # fingerprints and identities of the files, and their all-gather

    local = _Local(table=meta.table, source=opened.source)
    error: BaseException | None = None
    try:
        if early is not None:
            raise early
        _check_and_materialize(
            model, path, options, state, meta, choice, rank, group_rank, src_group_rank, device, local, clock
        )
    except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        error = exc
    # One short digest per rank, not every rank's placements: each rank derives the
    # placements it plans for from the specs it holds itself.
    gathered = gather_or_raise((local.digest, ties_here, local.replaced), error, rank, group, device)
    digests = [d for d, _, _ in gathered]
    agree_ties([t for _, t, _ in gathered], model, rank, group, device)
    clock.mark("agree_layout")
    replaced = [r for r, (_, _, changed) in enumerate(gathered) if changed]
    if replaced:
        # Some reader opened other files than the reader's (replaced since it opened them):
        # the reader alone reads, from the files it holds open; no rank mixes the two.
        choice = fall_back(choice, replaced)
        if group_rank != src_group_rank:
            local.source = None
        else:
            log.info("streamload: readers=%s (%s)", choice.mode.value, choice.reason)
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise PlacementError(
            f"the model's parameter layouts (names, shapes, dtypes, meshes, placements) differ between ranks: "
            f"group ranks {differ[:20]} differ from rank 0",
            rank=rank,
        )
    assert local.match is not None and local.conversion is not None
    # Everything between the digest all-gather and the first weight byte (the
    # plan, mapping shards, the strategy's groups) can fail on one rank only: it
    # runs inside a second agreement, so such a failure raises on every rank
    # instead of leaving the others waiting in the first bucket.
    strategy = make_strategy(choice)
    prep: Prepared | None = None
    error = None
    try:
        prep = _plan_and_map(
            model, options, clock, state, group, device, rank, group_rank, src_group_rank, choice, meta,
            local, len(digests),
        )  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        error = exc
    try:
        # Collective: every rank creates the same groups, even after a local failure above.
        strategy.open(choice, group, device)
    except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        error = error or exc
    clock.mark("strategy_open")
    try:
        # The agreement also carries each rank's bucket count: owners plans are per rank, node
        # plans per node, and every rank must take part in the same number of per-bucket steps.
        counts = gather_or_raise(len(prep.plan.buckets) if prep else 0, error, rank, group, device)
    except BaseException:
        strategy.close()  # every rank raises here, so every rank gives its groups back
        raise
    assert prep is not None
    if choice.mode in (ReaderMode.OWNERS, ReaderMode.NODE):
        pad_buckets(prep.plan, max(counts))
    prep.strategy = strategy
    clock.mark("agree_plan")
    return prep


def _plan_and_map(
    model: nn.Module,
    options: LoadOptions,
    clock: PhaseClock,
    state: ModelState,
    group: dist.ProcessGroup | None,
    device: torch.device,
    rank: int,
    group_rank: int,
    src_group_rank: int,
    choice: ReaderChoice,
    meta: SourceMeta,
    local: _Local,
    world: int,
) -> Prepared:
    """This rank's share of the work after the digest all-gather: plan, map, set up the shards."""
    assert local.match is not None and local.conversion is not None
    bucket_bytes = options.bucket_bytes or default_bucket_bytes(device)
    if choice.mode is ReaderMode.OWNERS and device.type == "cpu":
        # Every rank fills its shards in place: no staging, no wire. A bucket is
        # then only the stride of the error check, and a coarse one costs less.
        bucket_bytes = max(bucket_bytes, OWNERS_CPU_BUCKET_BYTES)
    served = served_ranks(choice, group_rank, world, src_group_rank)
    glob = [dist.get_global_rank(group, r) for r in served] if group is not None else [rank]
    dtypes = {k: v[0] for k, v in local.table.items()}
    if choice.mode is ReaderMode.SRC:
        plan, placements = _src_plan(local, dtypes, glob, world, bucket_bytes)
    else:
        placements = placements_for(local.specs, glob)
        validate_dtypes(local.match.targets, local.table, placements)
        plan = build_plan(local.match.targets, dtypes, placements, bucket_bytes)
    clock.mark("plan")
    if rank == options.src_rank and meta.tie_conflicts:
        warnings.warn(
            f"streamload: checkpoint holds tied tensors with different values: {meta.tie_conflicts}; "
            "the canonical tensor is loaded and the alias ignored (as transformers does)",
            stacklevel=5,
        )
    locals_ = [local_tensor(t) for t in local.tensors]
    mapped = MappedShards()
    ckpt = local.source
    readers = choice.reader_ranks(src_group_rank, world)
    if options.map_files and device.type == "cpu" and isinstance(ckpt, Checkpoint) and local.mine:
        if group_rank in readers:
            mapped = map_shards(
                plan.targets,
                [p.box for p in local.mine],
                local.tensors,
                locals_,
                ckpt,
                model,
                mapping_policy(options.map_files, local.tensors),
                copy_writable=options.map_files == "auto",
            )
            if mapped.ranges and ckpt.read_mode == "cold":
                # Views of cold files would fault page by page at first touch: read them in now.
                ckpt.engine.prefetch(mapped.ranges)
    fallbacks = FallbackSources(local.conversion, ckpt, model, local.quant) if ckpt is not None else None
    shards = Shards(
        locals_, fallbacks, options.slots, options.progress, mapped.targets, local.quant, options.prefault
    )
    shards.host = host_targets(local.tensors, device, offloads_to_cpu(model))  # never staged (FSDP2 offload)
    clock.mark("map")  # mapped views of the files and the fallback sources
    return Prepared(
        model, options, clock, state, group, device, rank, group_rank, src_group_rank, choice, meta, ckpt,
        local.match, local.table, placements, plan, bucket_bytes, shards, mapped, local.unrestored, served,
    )  # fmt: skip


def _src_plan(
    local: _Local, dtypes: dict[str, str], glob: list[int], world: int, bucket_bytes: int
) -> tuple[Plan, list[list[Placement]]]:
    """The ``src`` plan over ``glob`` (every rank on the reader, this rank alone on a receiver).

    Bucket boundaries come from the specs alone (``build_served_plan``), so a receiver places
    no other rank. Every rank's dtype is its spec's, which the digest proved equal everywhere:
    checking this rank's own gives every rank the same verdict.
    """
    assert local.match is not None
    targets = local.match.targets
    validate_dtypes(targets, local.table, [local.mine])
    layouts = [global_layout(s, world) for s in local.specs]
    if len(glob) == 1:
        mine = local.mine  # this rank's own, checked against its spec in _check_and_materialize

        def place(row: int, t_idx: int) -> Placement:
            return mine[t_idx]

    else:

        def place(row: int, t_idx: int) -> Placement:
            return placement_for(local.specs[t_idx], glob[row])

    return build_served_plan(targets, dtypes, layouts, len(glob), place, bucket_bytes), [local.mine]


def _on_readers_host(choice: ReaderChoice, group_rank: int, src_group_rank: int) -> bool:
    """Whether this rank opens the very files the reader opened (auto proved their identity)
    on the reader's own host, hence sees the same page cache."""
    if choice.proof is None:
        return False
    return any(group_rank in ranks and src_group_rank in ranks for ranks in choice.nodes)


def _takes_node_share(
    options: LoadOptions, choice: ReaderChoice, meta: SourceMeta, source: Source | None, group_rank: int
) -> bool:
    """Whether the reader, in ``owners`` mode with other ranks on its node, copies from its mapped
    files with its node share of copy threads (it opened them with all before the choice)."""
    if (
        options.threads is not None
        or choice.mode is not ReaderMode.OWNERS
        or not isinstance(source, Checkpoint)
    ):
        return False
    if meta.read_mode not in ("mmap", "pread"):
        return False
    return any(group_rank in ranks and len(ranks) > 1 for ranks in choice.nodes)


def _check_and_materialize(
    model: nn.Module,
    path: Any,
    options: LoadOptions,
    state: ModelState,
    meta: SourceMeta,
    choice: ReaderChoice,
    rank: int,
    group_rank: int,
    src_group_rank: int,
    device: torch.device,
    local: _Local,
    clock: PhaseClock,
) -> None:
    """This rank's share of the pre-stream checks, filling ``local`` as it goes."""
    # Overrides read only once the pipeline runs: a malformed one raises here, inside the agreement.
    for keyword in ("prefault", "progress"):
        env_flag(keyword, getattr(options, keyword))
    shapes = {name: tuple(t.shape) for name, t in state.targets().items()}
    if options.quantized not in ("dequantize", "keep"):
        raise ValueError(f"quantized must be 'dequantize' or 'keep', not {options.quantized!r}")
    # Quantized tensors become logical (dequantized) sources; their scales are consumed.
    view, quant = quantized_view(meta.table, scheme_from_config(getattr(model, "config", None)))
    if options.quantized == "keep":
        view, local.quant = meta.table, {}
    else:
        local.quant = quant
    outside: set[str] = set()
    if options.mapping is not None:  # the caller's names (e.g. torchtitan's adapter), not transformers'
        mapped = plan_mapping(options.mapping, model, view, shapes)
        local.conversion, outside = mapped.conversion, mapped.outside
    else:
        local.conversion = plan_conversions(model, view, shapes)
    local.table = {**view, **local.conversion.virtual_table}
    match = local.match = match_keys(state, shapes, local.table, *ignore_patterns(model), local.conversion)
    # Buffers the mapped format lacks whose module recomputes them: checked once written (below).
    match.missing = [n for n in match.missing if n not in outside]
    # A pipeline stage holds some layers: the checkpoint's other tensors are not its concern,
    # but anything the stage holds and the files lack still is.
    unexpected = match.unexpected if options.unexpected == "error" else []
    if options.strict and (match.missing or unexpected):
        raise KeyMismatchError(
            key_mismatch_reason(match.missing, unexpected),
            file=meta.path,
            rank=rank,
            missing=match.missing,
            unexpected=unexpected,
            hint=key_mismatch_hint(match.missing, unexpected, meta.path),
        )
    # Shapes and tilings need no allocation: check them before materialising.
    validate_shapes(match.targets, local.table)
    targets = state.targets()
    for t in match.targets:
        check_placements(t.name, getattr(targets[t.name], "placements", ()), len(t.shape))
    clock.mark("match")
    if is_meta(model):
        # to_empty() replaces the real tensors too: keep those the file does not fill.
        filled = {t.name for t in match.targets}
        uncovered = [n for n in state.targets() if n not in filled]
        saved = snapshot_real(model, uncovered)
        check_fsdp_device(model, device)
        if offloads_to_cpu(model):  # FSDP2 CPU offload: the shards live on the CPU
            materialize_offloaded(model, device)
        else:
            materialize(model, device)
        # Buffers their own module recomputes (torchtitan's _init_self_buffers), then the saved values back.
        recomputed = init_own_buffers(
            model, [*state.meta_buffers, *(n for n in uncovered if n not in saved)], device
        )
        # strict=True whatever the caller said: on a meta build an unwritten buffer holds to_empty's bytes.
        unwritten_is_loud([n for n in outside if n not in saved], recomputed, True, match.missing)
        state_left = replace(state, meta_buffers=[n for n in state.meta_buffers if n not in recomputed])
        local.unrestored = restore_buffers(model, state_left)
        fill = [n for n in uncovered if n not in recomputed or n in saved]
        fill_uncovered(model, fill, saved, rank, seed=meta.init_seed)
    rebind_ties(model, state.ties)
    clock.mark("materialize")
    local.tensors = [get_tensor(model, t.name) for t in match.targets]
    local.mine = [local_placement(x, t.name) for x, t in zip(local.tensors, match.targets, strict=True)]
    if options.quantized == "keep":
        check_kept(match.targets, [p.dtype for p in local.mine], quant, meta.table)
    local.specs = layout_specs(local.tensors)
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    for t, spec, own in zip(match.targets, local.specs, local.mine, strict=True):
        # What any rank derives for this one from the spec must be what this rank holds.
        if placement_for(spec, me) != own:
            raise PlacementError(
                f"placements {spec.placements}: the layout derived from the spec differs from this rank's shard",
                tensor=t.name,
            )
    local.digest = spec_digest([t.name for t in match.targets], local.specs)
    clock.mark("layout")
    mode = choice.mode
    reads = mode is ReaderMode.OWNERS or (mode is ReaderMode.NODE and group_rank in choice.node_readers)
    threads = options.threads
    if threads is None and mode is ReaderMode.OWNERS and choice.nodes:
        # Ranks of a node read at once: share its cores rather than oversubscribe them.
        on_node = next(len(ranks) for ranks in choice.nodes if group_rank in ranks)
        threads = max(1, worker_threads() // on_node)
    source = local.source
    if (
        reads
        and _takes_node_share(options, choice, meta, source, group_rank)
        and isinstance(source, Checkpoint)
        and threads
    ):
        # The reader opened its files before the choice, with every core's worth of copy threads;
        # its node's other ranks copy at once with their share: it takes its share too (a new
        # engine over the files it holds open), so that no rank ends last on fewer threads
        # while the reader's ran ahead on more.
        source.use_threads(threads)
    if reads and local.source is None:
        read_mode = options.read_mode
        if (
            read_mode == "auto"
            and meta.read_mode in ("mmap", "pread", "cold")
            and _on_readers_host(choice, group_rank, src_group_rank)
        ):
            # The reader's very files (auto's choice rests on their identity), on its host: their
            # page-cache residency is the one the reader just measured (mincore on about 16 MiB of pages per file).
            read_mode = meta.read_mode
        local.source = as_source(path, read_mode, threads, options.drop_cache, options.direct_io)
        # Not the files auto's choice rests on (replaced since the reader opened its own): the
        # ranks fall back to src after the next agreement, whatever this rank's files hold.
        local.replaced = not choice.proof_holds(local.source)
        if meta.objects is not None and opened_identity(local.source) != meta.objects:
            # Objects replaced since the reader opened them (whatever readers= asked for): the
            # reader alone reads the versions its table describes.
            local.replaced = True
        if not local.replaced:
            check_same_table(local.source, meta.table)
        clock.mark("open_own")  # this rank's own files: residency check (mincore), headers
