"""load_checkpoint, the driver: prepare -> a reader strategy runs the plan -> finalize."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..io.checkpoint import Checkpoint
from ..model.placement import resolve_device, resolve_group
from ..report import LoadReport
from ..timeline import PhaseClock, current, recording
from ..transport.arrival import meeting
from ..transport.protocol import close_route, open_wire_route
from ..transport.readers import ReaderMode
from ..transport.strategies import StreamResult
from .finalize import finalize
from .prepare import LoadOptions, prepare
from .source import OpenedSource


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
    drop_cache: bool = False,
    readers: str | ReaderMode = "auto",
    map_files: bool | str = "auto",
    quantized: str = "dequantize",
    unexpected: str = "error",
    mapping: Any = None,
    direct_io: bool | None = None,
    prefault: bool | None = None,
    node: str | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> LoadReport:
    """Streams a safetensors checkpoint into an FSDP2 (or plain) model.

    Only ``src_rank`` opens ``path``; other ranks receive the tensor table and then only their own
    shards' bytes. Meta models are materialised on the mesh's device first; ties are re-bound and
    non-persistent buffers restored afterwards. docs/options.md lists every keyword with when to
    change it; ``direct_io``, ``prefault``, ``progress`` and ``node`` left at None may be set from
    the environment instead (``STREAMLOAD_*``), a keyword passed explicitly wins.

    Args:
        model: a model, ``fully_shard``-ed or not, on meta or materialised.
        path: checkpoint file or directory, an open Checkpoint, or a dict of tensors (used on
            ``src_rank`` only; other ranks may pass anything, even a path that does not exist there, or None).
        src_rank: the global rank that reads.
        strict: raise KeyMismatchError on missing/unexpected keys (all ranks, before any weight is
            sent); else report them.
        bucket_bytes: bytes per collective, all ranks together (default: 64 MiB on CPU, 256 MiB on GPUs).
        slots: staging slots (>= 2 overlaps packing with transport); a CPU ``src``/``node``
            reader whose next bucket's reads land in its slot (cold, buffered:
            ``Packer.lands_ahead``) holds one more.
        progress: tqdm bar on ``src_rank`` (None: STREAMLOAD_PROGRESS=0/1 if set, else when stderr is a TTY).
        process_group: group to load over (default: the default group).
        device_mesh: the mesh the model is sharded on (for the device type).
        threads: native copy threads on the reader.
        read_mode: how the reader reads the files: "mmap", "pread", "cold" (large aligned reads in
            file order, read ahead across buckets, for files not in the page cache: buffered, each
            window asked of the kernel up front; O_DIRECT with ``drop_cache`` or ``direct_io=True``)
            or "auto" (the default: cold when less than half of the files is in the page cache,
            measured with mincore, else mmap). The choice is in ``LoadReport.read_mode``.
        drop_cache: leave the checkpoint out of the page cache (for hosts whose memory training
            needs): cold reads drop each window behind them; other modes evict the files at the end.
        readers: who reads (a ReaderMode or its name): "src" (``src_rank`` reads and scatters), "owners"
            (every rank reads its own shards, no transport), "node" (one reader per node scatters within
            its node), or "auto" (the default: owners when every rank opens the very same files - same
            device, inode, size and mtime -, node when each node has a rank that does, else src).
            "owners" and "node" trust that every reader's copy holds the reader's bytes (checked only
            by size, header and sampled blocks); auto accepts a file only when its (device, inode, size,
            mtime_ns), read from the descriptors each reader holds open, and its header and 16 sampled
            4 KiB blocks equal the reader's (docs/design.md). The choice and the reason are in
            ``LoadReport.reader``.
        map_files: on the CPU, a shard this rank reads itself that is one contiguous run of one checkpoint
            tensor in the parameter's dtype can become a copy-on-write view of the file (owning exactly
            its bytes) rather than a copy; the file is never written. "auto" (the default): only tensors
            no optimizer writes (``requires_grad=False``: frozen weights, buffers), since a first in-place
            update of a mapped page costs a copy-on-write fault, and only from files this process cannot
            write (``os.access(W_OK)`` false: read-only files, a read-only mount; as root, only a read-only
            mount), since a save into the checkpoint while the model lives (``save_pretrained`` into the
            directory it was loaded from) would change mapped weights or unmap them (SIGBUS); True: every
            mappable shard, writable files too (inference); False: private copies only.
        quantized: for a quantized checkpoint (``quantization_config`` fp8 with ``weight_block_size``,
            or mxfp4; FP8 weights with ``weight_scale_inv`` siblings are detected without one):
            "dequantize" (default) writes ``values x scales`` into each rank's floating-point shard on
            the fly, reading only the blocks and scale rows the shard needs, bit-exact with transformers'
            dequantization; "keep" loads the quantized values and their scales as they are into a model
            that holds them (e.g. fp8 weights and ``weight_scale_inv`` parameters, for fp8 training).
        unexpected: "error" (the default: with ``strict``, checkpoint tensors the model does not
            hold raise KeyMismatchError) or "ignore" (they are skipped and only listed in
            ``LoadReport.unexpected_keys``: a pipeline stage that holds some layers loads them from
            the whole checkpoint; a tensor the stage holds and the files lack still raises).
        mapping: the model's own names for the checkpoint's tensors, when they are not
            transformers' (e.g. torchtitan): torchtitan's state-dict adapter itself (its
            ``from_hf_map`` renames, per-expert stacking into ``[experts, ...]``, checked against
            its own ``from_hf`` on meta tensors), a ``{template: name}`` dict in the same form, or a
            callable ``checkpoint key -> model name | None``. Module load hooks (torchtitan's fused
            QKV) are applied as region algebra; anything with no exact region form is a
            ``MappingError`` on every rank. Persistent buffers the mapped format lacks
            (``moe.expert_bias_E``) keep their values, or are recomputed by their module
            (``_init_self_buffers``) on a model built on meta.
        direct_io: how cold reads (``read_mode`` "cold") read: None (the default:
            STREAMLOAD_DIRECT_IO=0/1 if set, else buffered, O_DIRECT with ``drop_cache``), True
            (O_DIRECT where the file system allows it, buffered where it refuses; for disks where
            O_DIRECT measures faster, or a reader short of CPU) or False (buffered, even with
            ``drop_cache``: each window is dropped behind the reader).
        prefault: fault in the pages of freshly allocated CPU shards ahead of their copy
            (``madvise(MADV_POPULATE_WRITE)``, Linux >= 5.14): the native engine before each piece
            it copies, and in ``src`` mode a helper thread on the receivers' shards. None (the
            default): on, unless STREAMLOAD_PREFAULT=0; False: off.
        node: this process's node id, which ``readers="node"`` / ``"auto"`` group ranks by. None
            (the default): STREAMLOAD_NODE if set, else torchrun's GROUP_RANK, else the host name;
            pass it where ranks on one host should count as separate nodes or the host name
            does not tell nodes apart.
        storage_options: for an object store ``path`` (``s3://``, ``gs://``, ``az://``): obstore's
            store config and client options (``endpoint``, ``region``, ``access_key_id``,
            ``allow_http``, ``timeout``, ...) plus ``retries`` (per request, default 8),
            ``concurrency`` (requests in flight per reader, default 16) and ``gap_cache_bytes``
            (bytes between a bucket's spans that a later bucket reads, fetched along and held
            until read, at most; default 128 MiB, 0: none); the standard environment
            (``AWS_ENDPOINT_URL``, ``AWS_*`` credentials) applies where a key is not given.
        timeout: seconds to wait for peers that have not called yet (None: ``STREAMLOAD_TIMEOUT``,
            else 300). It bounds only the wait for the group's ranks to arrive, never the load:
            a rank that raised or returned before calling becomes ``RankAbsentError`` on the
            others; ranks passing different ``src_rank``, ``strict``, ``bucket_bytes``, ``slots``,
            ``readers``, ``quantized`` or ``unexpected`` get ``OptionMismatchError``.

    Returns:
        A LoadReport.

    Example:
        >>> model = AutoModelForCausalLM.from_config(cfg)  # under torch.device("meta")
        >>> for layer in model.model.layers: fully_shard(layer)
        >>> fully_shard(model)
        >>> report = streamload.load_checkpoint(model, "/ckpt")
    """
    clock = PhaseClock()
    knobs = locals()  # every keyword above is a LoadOptions field of the same name
    options = LoadOptions(**{f.name: knobs[f.name] for f in fields(LoadOptions)})
    group = resolve_group(process_group, device_mesh)
    # The device type too: ranks that decide differently whether the load needs a gloo twin
    # (a CPU model on one rank, a device model on another) would part ways in new_group.
    agreed = {**options.agreed(), "device": resolve_device(model, device_mesh, group).type}
    with meeting("load_checkpoint", group, timeout, agreed):
        clock.mark("meet")
        return run_load(model, path, options, clock=clock)


def run_load(
    model: nn.Module,
    path: Any,
    options: LoadOptions,
    opened: OpenedSource | None = None,
    clock: PhaseClock | None = None,
) -> LoadReport:
    """The load itself, for callers that hold ``LoadOptions`` or an already opened checkpoint.

    Args:
        model, path: see ``load_checkpoint``.
        options: the load's knobs.
        opened: what ``open_source`` returned, when the caller opened the checkpoint
            itself (``from_pretrained`` reads the config with it).
        clock: the phase clock the caller started (``from_pretrained`` times its own
            phases with it); default: one started here.

    Returns:
        A LoadReport; its ``phases`` cover the call from the clock's start to the end
        (top-level phases add up to ``seconds``).
    """
    clock = clock or PhaseClock()
    # A CPU model over an NCCL-only group loads over a gloo twin of the group, made for this load.
    group = resolve_group(options.process_group, options.device_mesh)
    wire = open_wire_route(group, resolve_device(model, options.device_mesh, group))
    if wire.owned:
        options = replace(options, process_group=wire.group)
    with recording() as timeline:
        counted = current()  # this load's timeline, or a test's that every load records into
        before = dict(counted.counts)
        try:
            prep = prepare(model, path, options, opened, clock)
            strategy = prep.strategy
            assert strategy is not None
            result: StreamResult
            try:
                result = strategy.run(prep)
                clock.mark("stream")
            finally:
                strategy.close()
            clock.mark("close")
            report = finalize(prep, result)
        finally:
            close_route(wire, "the load's gloo group")
    report.phases.update(timeline.phases())  # the stream's steps: where its time went
    report.disk_bytes_read = counted.counts.get("disk_bytes", 0) - before.get("disk_bytes", 0)
    report.disk_reads = counted.counts.get("disk_reads", 0) - before.get("disk_reads", 0)
    clock.mark("finalize")
    report.phases.update(clock.phases)
    report.seconds = clock.total()
    report.gbps = report.payload_bytes / report.seconds / 1e9 if report.seconds > 0 else 0.0
    return report
