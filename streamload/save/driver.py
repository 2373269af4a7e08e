"""save_pretrained: an FSDP2 / TP / EP (or plain) model written as transformers'
own ``save_pretrained`` of the gathered model would write it, every rank
writing its own bytes, in one pass, atomically."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import MappingError, RankLostError, SaveError
from ..model.placement import resolve_device, resolve_group
from ..timeline import PhaseClock
from ..transport.arrival import meeting
from ..transport.protocol import StatusRoute, carries_cpu, close_route, open_status_route, open_wire_route
from .commit import Output, open_output
from .gather import write_src
from .layout import INDEX_NAME, Layout, output_layout, saved_config
from .mapped import check_mapping, describe, mapped_layout
from .plan import SavePlan, plan_save
from .quantize import QUANTIZE, agree_fp8, plan_fp8
from .tiling import check_tiling
from .write import WriteStats, progress_bar, write_headers, write_owners

WRITERS = ("auto", "owners", "src")
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class SaveReport:
    """What one save did, on this rank.

    Attributes:
        bytes_written: bytes this rank wrote (tensor data, plus headers and small files on
            the rank that writes them).
        files: the output files (safetensors, index, configs), relative to the directory.
        seconds: wall time of the whole save.
        writers: the writer mode used (``"owners"`` or ``"src"``).
        phases: seconds per phase (open, layout, plan, tiling, write, commit).
        peak_buffer_bytes: the largest host buffer the writer held at once (at most the bucket).
        writes: write calls this rank made.
    """

    bytes_written: int = 0
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    writers: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    peak_buffer_bytes: int = 0
    writes: int = 0


def _small_files(
    model: nn.Module,
    config: Any,
    dtype: torch.dtype | None,
    layout: Layout,
    tmp: str,
    write: bool,
    quantization: dict[str, Any] | None = None,
    configs: bool = True,
) -> list[str]:
    """Index, config.json (with ``quantization`` as its ``quantization_config`` when given) and
    generation_config.json: their names on every rank, the files written where ``write`` (one rank)."""
    names = []
    if layout.index is not None:
        if write:
            with open(os.path.join(tmp, INDEX_NAME), "wb") as f:
                f.write(layout.index)
        names.append(INDEX_NAME)
    if not configs:  # weights only (mapping="state_dict", as accelerate's save_model)
        return names
    cfg = saved_config(model, config, dtype)
    if cfg is not None and quantization is not None:
        cfg.quantization_config = quantization
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        if write:
            cfg.save_pretrained(tmp)
        names.append("config.json")
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if gen is not None and callable(can_generate) and can_generate():
        if write:
            gen.save_pretrained(tmp)
        names.append("generation_config.json")
    return names


def _write(
    mode: str,
    plan: SavePlan,
    layout: Layout,
    fds: dict[str, int],
    bucket_bytes: int,
    group: Any,
    device: torch.device | None = None,
    bar: Any = None,
) -> WriteStats:
    if mode == "owners":
        return write_owners(plan, layout, fds, bucket_bytes, bar)
    return write_src(plan, layout, fds, bucket_bytes, group, device, bar)


def save_pretrained(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str | None = "5GB",
    writers: str = "auto",
    process_group: dist.ProcessGroup | None = None,
    device_mesh: Any = None,
    config: Any = None,
    progress: bool | None = None,
    bucket_bytes: int | None = None,
    timeout: float | None = None,
    quantize: str | None = None,
    mapping: Any = None,
    extra_files: Callable[[str], Any] | None = None,
) -> SaveReport:
    """Writes ``model`` as the Hugging Face checkpoint transformers' ``save_pretrained``
    writes for the same gathered model; collective over the save's group.

    No rank gathers a full tensor: the layout (names, files, offsets, headers) is planned
    from global shapes on every rank, and each rank writes the bytes of its own shards
    (one replica of replicated ones) through a bucket-sized buffer. The directory appears
    only after every rank's writes succeeded (temporary sibling directory, fsync, rename);
    an existing ``out_dir`` is replaced atomically.

    Args:
        model: the model (FSDP2 / DTensor parameters, or a plain module).
        out_dir: the checkpoint directory to write (created or replaced).
        dtype: cast floating-point tensors to this dtype on the way out (torch's rounding).
        max_shard_size: largest file before splitting, as transformers' ``max_shard_size``; None
            only with an adapter ``mapping``: the files torchtitan writes (its
            ``fqn_to_index_mapping``, the hub checkpoint's split, else one file).
        writers: ``"owners"`` (every rank writes into the files; one file system every
            rank sees), ``"src"`` (one rank writes, the others send their pieces) or
            ``"auto"`` (owners when every rank sees the temporary directory, else src).
        process_group: the save's group (default: ``device_mesh``'s ranks - a 1-D mesh's group,
            a group over an N-d mesh's ranks made by them alone (``model.placement.mesh_group``) -, else the default group when
            torch.distributed is initialized, else one process). It must hold every rank
            that holds a shard: a smaller group is a ``SaveError`` on every rank.
        device_mesh: the model's mesh (finds the group and the device of the agreements).
        config: the config to write (default ``model.config``).
        progress: a tqdm bar on group rank 0 of the bytes it writes and their rate (None:
            ``STREAMLOAD_PROGRESS=0/1`` if set, else when stderr is a TTY, as for loads).
        bucket_bytes: host buffer bytes per rank (default 64 MiB).
        timeout: seconds to wait for peers that have not called (None: ``STREAMLOAD_TIMEOUT``,
            else 300); it bounds only that wait, never the save. Ranks that never call make
            ``RankAbsentError`` on the others; different ``dtype``, ``max_shard_size``,
            ``writers``, ``bucket_bytes`` or ``quantize`` across ranks, ``OptionMismatchError``.
        quantize: ``"fp8"``: DeepSeek-V3's block-scaled float8_e4m3fn (a float32
            ``weight_scale_inv`` per 128x128 block, ``quantization_config`` in config.json) for
            the weights transformers' fp8 quantizer converts; the rest as without it
            (``save.quantize``). None: no quantization.
        mapping: the output names when they are not transformers' (``save.mapped``): a
            torchtitan-style state-dict adapter (its ``to_hf`` names and shapes; the bytes by
            the load's region form of its ``from_hf``, ``MappingError`` on every rank where
            that form does not invert it), or ``"state_dict"``: the model's own state-dict
            names, no conversion, weights only (accelerate's ``save_model``). None: transformers'.
        extra_files: called on group rank 0 with the temporary directory once the weights and
            configs are in it, before the commit: the checkpoint's other files (a tokenizer's
            ``save_pretrained(dir)``), which then appear with the weights or not at all; a
            failure in it is the save's ``SaveError`` on every rank, the target untouched. Other
            ranks' value is ignored.

    Returns:
        SaveReport for this rank.

    Raises:
        SaveError: on every rank when any rank failed (a rank lost mid-save included, named);
            ``out_dir`` is left as it was.
        RankAbsentError, OptionMismatchError: before anything was written.

    Example:
        >>> model = streamload.from_pretrained("Qwen/Qwen2.5-0.5B-local")
        >>> streamload.save_pretrained(model, "out/qwen", max_shard_size="1GB")
    """
    if writers not in WRITERS:
        raise ValueError(f"writers must be one of {WRITERS}, not {writers!r}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, not {quantize!r}")
    check_mapping(mapping)
    if max_shard_size is None and (mapping is None or isinstance(mapping, str)):
        raise ValueError("max_shard_size=None takes its files from an adapter mapping: pass a size")
    if mapping is not None and quantize is not None:
        raise ValueError("quantize and mapping cannot be combined")
    group = resolve_group(process_group, device_mesh)
    bucket = int(bucket_bytes) if bucket_bytes else DEFAULT_BUCKET_BYTES  # None == the default
    agreed = {
        "dtype": dtype,
        "max_shard_size": max_shard_size,
        "writers": writers,
        "bucket_bytes": bucket,
        "quantize": quantize,
        "mapping": describe(mapping),
        # Ranks that decide differently whether the save needs a gloo twin would part ways.
        "device": resolve_device(model, device_mesh, group).type,
    }
    try:
        with meeting("save_pretrained", group, timeout, agreed):
            asked = _Asked(
                dtype, max_shard_size, writers, config, bucket, progress, quantize, mapping, extra_files
            )
            return _save(model, out_dir, asked, group, device_mesh)
    except RankLostError as exc:  # a peer died: the save's promise is a SaveError, the lost ranks named
        raise SaveError(exc.reason, rank=exc.rank, hint=exc.hint) from exc


@dataclass(frozen=True)
class _Asked:
    """What the caller asked of one save (agreed equal on every rank by the meeting)."""

    dtype: torch.dtype | None
    max_shard_size: int | str | None
    writers: str
    config: Any
    bucket: int
    progress: bool | None = None
    quantize: str | None = None
    mapping: Any = None
    extra_files: Callable[[str], Any] | None = None  # group rank 0's only (a callable: not agreed)


def _save(
    model: nn.Module,
    out_dir: str | os.PathLike,
    asked: _Asked,
    group: dist.ProcessGroup | None,
    device_mesh: Any,
) -> SaveReport:
    """``save_pretrained`` once the ranks met."""
    clock = PhaseClock()
    rank = dist.get_rank(group) if group is not None else 0
    report = SaveReport()
    # The data's wire: the CPU on gloo, else the model's own device (never blindly
    # current_device(), which is cuda:0 on every rank that never called set_device). The
    # agreements travel on the status route: on an NCCL-only group spanning the world, a gloo
    # twin of it for this save, so a rank that died is noticed (``wait_work``) instead of
    # waited for until NCCL's watchdog, and an agreement never waits for the device.
    wire = (
        torch.device("cpu")
        if group is None or carries_cpu(group)
        else resolve_device(model, device_mesh, group)
    )
    # A CPU model under an NCCL-only group: the data, the src exchange too, over a gloo twin
    # (refused by name over part of the world), which carries the agreements as well.
    carrier = open_wire_route(group, wire) if wire.type == "cpu" else StatusRoute(group, wire)
    try:
        route = carrier if carrier.owned else open_status_route(carrier.group, wire)
        try:
            out = open_output(out_dir, route.group, route.device)
            _write_all(model, out, asked, report, clock, rank, carrier.group, wire)
        finally:
            close_route(route, "the save's status group")
    finally:
        close_route(carrier, "the save's gloo group")
    clock.mark("commit")
    report.phases = clock.phases
    report.seconds = time.perf_counter() - clock.start
    return report


def _write_all(
    model: nn.Module,
    out: Output,
    asked: _Asked,
    report: SaveReport,
    clock: PhaseClock,
    rank: int,
    group: dist.ProcessGroup | None,
    wire: torch.device,
) -> None:
    """Plans, checks the tiling, writes and commits ``out``; agreements on ``out``'s group,
    the src writer's data over ``group`` on ``wire``."""
    clock.mark("open")
    local: BaseException | None = None
    configs = True
    try:
        try:
            size = asked.max_shard_size if asked.max_shard_size is not None else "5GB"  # None: mapped only
            if asked.quantize == "fp8":
                layout, plan = plan_fp8(model, asked.dtype, size, rank, asked.bucket)
            elif asked.mapping is not None:
                layout, tiles, configs = mapped_layout(
                    model, asked.mapping, asked.dtype, asked.max_shard_size
                )
                plan = plan_save(model, layout, rank, tiles)
            else:
                layout = output_layout(model, dtype=asked.dtype, max_shard_size=size)
                clock.mark("layout")
                plan = plan_save(model, layout, rank)
            clock.mark("plan")
        except BaseException as exc:  # noqa: BLE001 - agreed below: the same error on every rank
            local = exc  # a KeyboardInterrupt too: skipping the agreement would hang the others
        out.agree(local)
        if plan.fp8 is not None:  # the amax of blocks cut by shard edges, agreed; the scales planned
            try:
                plan = agree_fp8(plan, layout, out.group, out.device)
            except BaseException as exc:  # noqa: BLE001 - after its gather: agreed here, not left alone
                local = exc
            out.agree(local)
        plan = check_tiling(layout, plan, out.group, out.device)
        clock.mark("tiling")
        out.create_files({f.name: f.size for f in layout.files})
        mode = asked.writers if asked.writers != "auto" else ("owners" if out.shared() else "src")
        report.writers = mode
        # src: only the writer opens the files (the others may not see the directory at all).
        fds: dict[str, int] = {}
        try:
            if mode == "owners" or rank == 0:
                fds = {f.name: out.open(f.name) for f in layout.files}
        except BaseException as exc:  # noqa: BLE001 - agreed: a rank that cannot open must not write alone
            local = exc
        out.agree(local)
        bar = None
        if rank == 0:  # owners: rank 0's own bytes; src: every byte (rank 0 writes them all)
            total = (
                plan.bytes_to_write(layout)
                if mode == "owners"
                else sum(t.nbytes for t in layout.tensors.values())
            )
            bar = progress_bar(total, asked.progress, f"streamload save ({mode})")
        try:
            stats = _write(mode, plan, layout, fds, asked.bucket, group, wire, bar)
        finally:
            if bar is not None:
                bar.close()
        report.bytes_written += stats.bytes_written
        report.writes = stats.writes
        report.peak_buffer_bytes = stats.peak_buffer_bytes
        if rank == 0:
            report.bytes_written += write_headers(layout, fds)
        quantization = plan.fp8.choice.config() if plan.fp8 is not None else None
        small = _small_files(
            model, asked.config, asked.dtype, layout, str(out.tmp_dir), rank == 0, quantization, configs
        )
        report.files = [f.name for f in layout.files] + small
        if rank == 0 and asked.extra_files is not None:
            # Into the temporary directory, before the commit: they appear with the weights or not at all.
            asked.extra_files(str(out.tmp_dir))
        clock.mark("write")
    except BaseException as exc:
        # This rank's own planning failure when the agreement raised for it: finish re-raises
        # an interrupt as itself on this rank.
        try:
            out.finish(ok=False, error=local if local is not None else exc)
        except SaveError:
            if isinstance(local, MappingError):  # planned alike on every rank: the mapping's own error
                raise local from None
            raise
        raise
    out.finish(ok=True)
