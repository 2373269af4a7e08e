"""Loading strategies, each run on every rank of a fresh process group.

Each takes (ckpt, mesh, dtype, options) and returns the loaded, sharded model.
They reproduce the call sequences frameworks use today, with plain torch and
transformers."""

from __future__ import annotations

import importlib
import inspect
import os
import typing
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...integrations.pretrained import default_shard_fn, meta_model

# load_checkpoint's keywords that the bench sets itself: the model, the mesh, who reads
# (the strategy's name says: rank 0 reads) and the progress bar (off while timing).
BENCH_SETS = frozenset({"model", "path", "src_rank", "process_group", "device_mesh", "readers", "progress"})


def load_keywords() -> list[str]:
    """The keywords of ``streamload.load_checkpoint`` a bench run may pass to the streamload
    strategies (``streamload bench --options``): every keyword but those in ``BENCH_SETS``.

    Example:
        >>> "direct_io" in load_keywords()
        True
    """
    from ...load.driver import load_checkpoint

    params = inspect.signature(load_checkpoint).parameters.values()
    return [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in BENCH_SETS]


def keyword_annotation(name: str) -> str:
    """``load_checkpoint``'s annotation of keyword ``name``, as written (e.g. ``"bool | None"``)."""
    from ...load.driver import load_checkpoint

    return str(inspect.signature(load_checkpoint).parameters[name].annotation)


def _load_kw(opts: dict[str, Any]) -> dict[str, Any]:
    """The run's options that are load_checkpoint keywords (the rest are the bench's own)."""
    names = set(load_keywords())
    return {k: v for k, v in opts.items() if k in names}


def quiet_from_pretrained(ckpt: str, dtype: torch.dtype, **kw: Any) -> nn.Module:
    """transformers' ``from_pretrained`` with its logging, progress bars and warnings silenced."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ..quantized import hf_reference_kwargs

        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, **{**hf_reference_kwargs(ckpt), **kw})


def load_streamload(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    import streamload

    kw = _load_kw(opts)
    path = ckpt if dist.get_rank() == 0 else "/nonexistent"  # only the reader needs the files
    return streamload.from_pretrained(path, device_mesh=mesh, dtype=dtype, progress=False, **kw)


def load_streamload_owners(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """Every rank reads its own shards (readers="owners"): no transport."""
    import streamload

    kw = _load_kw(opts)
    return streamload.from_pretrained(
        ckpt, device_mesh=mesh, dtype=dtype, progress=False, readers="owners", **kw
    )


def _owners_with(map_files: bool) -> Callable[[str, Any, torch.dtype, dict[str, Any]], nn.Module]:
    """readers="owners" with ``map_files`` forced: True maps every mappable shard, False copies all."""

    def load(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
        return load_streamload_owners(ckpt, mesh, dtype, {**opts, "map_files": map_files})

    return load


def load_streamload_auto(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """Every rank is given the path; streamload picks the reader mode."""
    import streamload

    kw = _load_kw(opts)
    return streamload.from_pretrained(
        ckpt, device_mesh=mesh, dtype=dtype, progress=False, readers="auto", **kw
    )


def load_hf_native(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """transformers' own distributed from_pretrained (DistributedConfig with FSDP2)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    return quiet_from_pretrained(
        ckpt, dtype, distributed_config=DistributedConfig(fsdp_size=dist.get_world_size())
    )


def load_rank0_broadcast(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """verl's way: rank 0 from_pretrained, others meta, fully_shard,
    set_model_state_dict(broadcast_from_rank0=True), buffers broadcast, tie_weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dist.get_rank() == 0:
        model = quiet_from_pretrained(ckpt, dtype)
        full_state = model.state_dict()
    else:
        model = meta_model(ckpt, dtype)
        full_state = {}
    default_shard_fn(model, mesh)
    if dist.get_rank() != 0:
        model.to_empty(device=mesh.device_type)
    set_model_state_dict(
        model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    del full_state
    for buf in model.buffers():
        dist.broadcast(buf, src=0)
    if hasattr(model, "tie_weights"):
        typing.cast(typing.Any, model).tie_weights()
    return model


def load_all_ranks(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """verl's way for tied models: every rank from_pretrained, then fully_shard."""

    model = quiet_from_pretrained(ckpt, dtype)
    default_shard_fn(model, mesh)
    return model


def load_accelerate_efficient(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """from_pretrained under accelerate's FSDP cpu_ram_efficient_loading flags."""

    os.environ["ACCELERATE_USE_FSDP"] = "true"
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
    try:
        model = quiet_from_pretrained(ckpt, dtype)
    finally:
        os.environ.pop("ACCELERATE_USE_FSDP", None)
        os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
    default_shard_fn(model, mesh)
    return model


def _sharded_empty(ckpt: str, mesh: Any, dtype: torch.dtype) -> nn.Module:
    """The model on meta, sharded, materialised empty with its buffers put back."""
    model = meta_model(ckpt, dtype)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    default_shard_fn(model, mesh)
    model.to_empty(device=mesh.device_type)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    return model


def load_dcp_hf(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """meta, fully_shard, to_empty, torch.distributed.checkpoint.load with HuggingFaceStorageReader."""
    import torch.distributed.checkpoint as dcp

    model = _sharded_empty(ckpt, mesh, dtype)
    state = {
        k: v
        for k, v in model.state_dict().items()
        if not k.endswith("lm_head.weight") or not getattr(model.config, "tie_word_embeddings", False)
    }
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(ckpt))
    if hasattr(model, "tie_weights"):
        typing.cast(typing.Any, model).tie_weights()
    return model


def load_fastsafetensors(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """fastsafetensors' own distributed loader on CPU (``SafeTensorsFileLoader``,
    no GDS): each rank reads a share of the files, then ``get_sharded`` scatters
    each Shard(0) parameter and ``get_tensor`` broadcasts the rest. Per-expert
    MoE tensors are stacked into the fused experts here (fastsafetensors has no
    conversion mapping)."""
    from pathlib import Path

    from fastsafetensors import SafeTensorsFileLoader
    from torch.distributed.tensor import DTensor, Shard

    model = _sharded_empty(ckpt, mesh, dtype)
    files = sorted(str(p) for p in Path(ckpt).glob("*.safetensors"))
    world = dist.get_world_size()
    loader = SafeTensorsFileLoader(dist.group.WORLD, "cpu", nogds=True)
    loader.add_filenames({r: files[r::world] for r in range(world) if files[r::world]})
    fb = loader.copy_files_to_device()
    keys = set(fb.key_to_rank_lidx)
    tied = getattr(model.config, "tie_word_embeddings", False)

    def experts(prefix: str, names: tuple[str, ...]) -> torch.Tensor:
        out = []
        e = 0
        while f"{prefix}.{e}.{names[0]}.weight" in keys:
            out.append(torch.cat([fb.get_tensor(f"{prefix}.{e}.{n}.weight") for n in names], dim=0))
            e += 1
        if not out:
            raise KeyError(f"{prefix}: not in the checkpoint")
        return torch.stack(out)

    with torch.no_grad():
        for name, p in model.state_dict().items():
            if tied and name.endswith("lm_head.weight"):
                continue
            local = p.to_local() if isinstance(p, DTensor) else p
            if name in keys:
                # gloo's scatter needs equal chunks: uneven dims are broadcast and sliced.
                sharded = isinstance(p, DTensor) and p.placements[0] == Shard(0) and p.shape[0] % world == 0
                t = fb.get_sharded(name, 0) if sharded else fb.get_tensor(name)
            elif name.endswith("experts.gate_up_proj"):
                t = experts(name.rsplit(".", 1)[0], ("gate_proj", "up_proj"))
            elif name.endswith("experts.down_proj"):
                t = experts(name.rsplit(".", 1)[0], ("down_proj",))
            else:
                continue  # non-persistent buffers were restored above
            if t.shape != local.shape and isinstance(p, DTensor):
                # Fused experts arrive whole: keep this rank's chunk.
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                t = t[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
            local.copy_(t.to(local.dtype))
    fb.close()
    loader.close()
    if hasattr(model, "tie_weights"):
        typing.cast(typing.Any, model).tie_weights()
    return model


def shard_ranges(ckpt: str, rank: int, world: int) -> list[tuple[str, int, int]]:
    """(file, offset, bytes) of this rank's share of every tensor in the checkpoint's files:
    its dim-0 chunk as FSDP2's ``Shard(0)`` cuts it (``ceil(rows / world)`` rows per rank), in
    file order. The bytes a dense model's fully_shard-ed shards hold; for per-expert MoE files
    the same amount (the fused experts' ranks own whole experts instead).

    Example:
        >>> sum(n for _, _, n in shard_ranges("/ckpt", 0, 2))
    """
    import json
    import struct
    from pathlib import Path

    root = Path(ckpt)
    out = []
    for f in sorted(root.glob("*.safetensors")) if root.is_dir() else [root]:
        with open(f, "rb") as h:
            n = struct.unpack("<Q", h.read(8))[0]
            header = json.loads(h.read(n))
        base = 8 + n
        tensors = sorted(
            (v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"]
        )
        for info in tensors:
            begin, end = info["data_offsets"]
            rows = info["shape"][0] if info["shape"] else 1
            row_bytes = (end - begin) // max(rows, 1)
            chunk = -(-rows // world)
            lo, hi = min(rows, rank * chunk), min(rows, (rank + 1) * chunk)
            if hi > lo:
                out.append((str(f), base + begin + lo * row_bytes, (hi - lo) * row_bytes))
    return out


class FloorReport:
    """What a floor run reports in place of a LoadReport: its bytes and phases."""

    def __init__(self, payload_bytes: int, phases: dict[str, float]) -> None:
        self.payload_bytes = payload_bytes
        self.disk_bytes_read = 0
        self.phases = phases


def _floor(pages: str) -> Callable[[str, Any, torch.dtype, dict[str, Any]], nn.Module]:
    """The floor of a warm load on this rank: allocate its shard bytes (one fresh buffer) and copy
    them from mappings of the page-cached files in one pass (``shard_ranges``, one thread). What
    any loader must at least do: fault in fresh memory and copy every byte once. ``pages``:
    ``"4k"`` faults 4 KiB pages one at a time as the copy writes them; ``"thp"`` asks for
    transparent huge pages (``madvise(MADV_HUGEPAGE)``) first; ``"populate"`` faults the 4 KiB
    pages in with one ``madvise(MADV_POPULATE_WRITE)`` before the copy (what streamload's copy
    engine does per piece)."""

    def load(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
        import mmap
        import time

        import numpy as np

        from ...transport.prefault import (
            HUGE_PAGE,
            MADV_HUGEPAGE,
            MADV_NOHUGEPAGE,
            MADV_POPULATE_WRITE,
            advise,
        )

        t0 = time.perf_counter()
        ranges = shard_ranges(ckpt, dist.get_rank(), dist.get_world_size())
        total = sum(n for _, _, n in ranges)
        t1 = time.perf_counter()
        raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % HUGE_PAGE  # huge pages need 2 MiB-aligned runs
        buf = raw[skip : skip + total]
        if total:
            span = [(buf.data_ptr(), buf.data_ptr() + total)]  # 2 MiB-aligned: whole pages
            advise(span, MADV_HUGEPAGE if pages == "thp" else MADV_NOHUGEPAGE)
            if pages == "populate":
                advise(span, MADV_POPULATE_WRITE)
        t2 = time.perf_counter()
        dst = buf.numpy()
        at = 0
        maps: dict[str, mmap.mmap] = {}
        views: dict[str, np.ndarray] = {}
        for path, offset, n in ranges:
            if path not in maps:
                with open(path, "rb") as h:
                    maps[path] = mmap.mmap(h.fileno(), 0, prot=mmap.PROT_READ)
                views[path] = np.frombuffer(maps[path], dtype=np.uint8)
            dst[at : at + n] = views[path][offset : offset + n]
            at += n
        views.clear()  # no view may outlive its mapping
        for m in maps.values():
            m.close()
        t3 = time.perf_counter()
        model = nn.Module()
        model.shards = nn.Parameter(buf, requires_grad=False)
        phases = {"ranges": t1 - t0, "alloc": t2 - t1, "copy": t3 - t2}
        model.streamload_report = FloorReport(total, phases)  # type: ignore[assignment]
        return model

    return load


# Pseudo-strategies: the floor of a warm load, measured beside the loaders (not loaders themselves).
FLOORS: dict[str, Callable[[str, Any, torch.dtype, dict[str, Any]], nn.Module]] = {
    "floor": _floor("4k"),
    "floor_thp": _floor("thp"),
    "floor_populate": _floor("populate"),
}


STRATEGIES: dict[str, Callable[[str, Any, torch.dtype, dict[str, Any]], nn.Module]] = {
    "streamload": load_streamload,
    "streamload_owners": load_streamload_owners,
    "streamload_auto": load_streamload_auto,
    "streamload_owners_mapped": _owners_with(True),
    "streamload_owners_copies": _owners_with(False),
    "rank0_broadcast": load_rank0_broadcast,
    "all_ranks": load_all_ranks,
    "accelerate_efficient": load_accelerate_efficient,
    "dcp_hf": load_dcp_hf,
    "hf_native": load_hf_native,
    "fastsafetensors": load_fastsafetensors,
    **FLOORS,
}

# Real clients' own load code (AReaL, accelerate) and the same with streamload swapped in.
from .clients import CLIENT_STRATEGIES  # noqa: E402 - clients.py needs nothing from here

STRATEGIES.update(CLIENT_STRATEGIES)


def strategy_fn(name: str) -> Callable[[str, Any, torch.dtype, dict[str, Any]], nn.Module]:
    """A strategy by name: a built-in one, or ``"package.module:function"`` (a client's benchmark
    brings its own, e.g. ``streamload.tools.verl_engine:bench_verl_own``).

    Args:
        name: a key of ``STRATEGIES`` or an import path with a colon.

    Returns:
        The strategy function.

    Example:
        >>> strategy_fn("streamload")
    """
    if name in STRATEGIES:
        return STRATEGIES[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise KeyError(f"unknown strategy {name!r}: one of {sorted(STRATEGIES)} or 'module:function'")
    return typing.cast(Any, getattr(importlib.import_module(module), attr))
