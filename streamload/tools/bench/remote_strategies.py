"""Strategies for ``streamload bench --remote``: ways to load a checkpoint served from S3, and
plain ranged reads of its objects that set the endpoint's ceiling.

Each takes ``(ckpt, mesh, dtype, opts)`` on every rank of a fresh process group, as the load
bench's strategies do (``ckpt`` is the local copy: only the correctness pass reads it), and reads
the checkpoint from ``opts["remote_url"]`` with ``opts["remote_options"]`` (obstore's storage
options) or ``opts["remote_env"]`` (the standard AWS environment, for SDKs that read it). Each
rank writes what it fetched to ``opts["stats_dir"]/<rank>.json`` (bytes, requests, retries where
the client counts them), which the bench adds to the run's figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import typing
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .strategies import _load_kw, _sharded_empty

MiB = 1 << 20
RANGE_BYTES = 8 * MiB  # one ranged GET
IN_FLIGHT = 16  # ranged GETs in flight per rank
# obstore's HTTP client options; every other storage option is the store's own config.
CLIENT_OPTIONS = frozenset(
    {"allow_http", "allow_invalid_certificates", "timeout", "connect_timeout", "proxy_url"}
)


@dataclass(frozen=True)
class Part:
    """One ranged GET: ``[start, end)`` of object ``path``, landing at ``dest`` of its sink."""

    path: str
    start: int
    end: int
    dest: int


def object_store(url: str, options: dict[str, Any]) -> tuple[Any, Any]:
    """The loader's obstore store for ``url``'s bucket (``make_store``: ``options`` are
    ``storage_options``), and ``url`` as the loader's ``RemotePath`` (bucket, prefix)."""
    from ...io.remote import as_remote, make_store

    remote = as_remote(url, options)
    return make_store(remote), remote


def list_objects(store: Any, remote: Any, suffix: str = "") -> list[tuple[str, int]]:
    """(key, size) of every object under ``remote``'s prefix whose name ends with ``suffix``, sorted."""
    import obstore

    prefix = remote.prefix + "/" if remote.prefix else None
    found = [(o["path"], o["size"]) for batch in obstore.list(store, prefix=prefix) for o in batch]
    return sorted((k, n) for k, n in found if k.endswith(suffix))


def whole_objects(objects: Sequence[tuple[str, int]], chunk: int = RANGE_BYTES) -> list[Part]:
    """Every object cut into ``chunk``-sized ranges, each landing at its own offset in its object."""
    return [Part(p, s, min(s + chunk, n), s) for p, n in objects for s in range(0, n, chunk)]


def rank_share(
    objects: Sequence[tuple[str, int]], rank: int, world: int, chunk: int = RANGE_BYTES
) -> list[Part]:
    """Rank ``rank``'s 1/``world`` share of the objects' bytes (taken as one concatenated space, cut
    at object ends) in ``chunk``-sized ranges; ``dest`` is the offset in the rank's buffer.

    Example:
        >>> [(p.path, p.start, p.end, p.dest) for p in rank_share([("a", 10), ("b", 6)], 1, 2, chunk=4)]
        [('a', 8, 10, 0), ('b', 0, 4, 2), ('b', 4, 6, 6)]
    """
    total = sum(n for _, n in objects)
    lo, hi = total * rank // world, total * (rank + 1) // world
    parts: list[Part] = []
    base = 0
    for path, size in objects:
        start, end = max(lo, base), min(hi, base + size)
        for s in range(start, end, chunk):
            e = min(s + chunk, end)
            parts.append(Part(path, s - base, e - base, s - lo))
        base += size
    return parts


async def _pump(
    parts: Sequence[Part],
    fetch: Callable[[Part], Awaitable[Any]],
    sink: Callable[[Part, memoryview], None],
    in_flight: int,
) -> None:
    """Fetches every part with ``in_flight`` GETs outstanding, handing each to ``sink`` as it lands."""
    queue = iter(parts)  # shared by the lanes: the event loop runs one at a time

    async def lane() -> None:
        for part in queue:
            data = memoryview(await fetch(part))
            if len(data) != part.end - part.start:
                raise OSError(f"{part.path} [{part.start}, {part.end}): got {len(data)} bytes")
            sink(part, data)

    await asyncio.gather(*(lane() for _ in range(in_flight)))


def obstore_get(store: Any) -> Callable[[Part], Awaitable[Any]]:
    """A part's ranged GET with obstore."""
    import obstore

    def fetch(part: Part) -> Awaitable[Any]:
        return obstore.get_range_async(store, part.path, start=part.start, end=part.end)

    return fetch


def read_into(buf: memoryview) -> Callable[[Part, memoryview], None]:
    """A sink copying each part to its ``dest`` in ``buf``."""

    def sink(part: Part, data: memoryview) -> None:
        buf[part.dest : part.dest + len(data)] = data

    return sink


def _buffer(parts: Sequence[Part]) -> tuple[torch.Tensor, memoryview]:
    """A preallocated byte buffer the parts land in (untouched until they do)."""
    size = max((p.dest + p.end - p.start for p in parts), default=0)
    buf = torch.empty(size, dtype=torch.uint8)
    return buf, memoryview(typing.cast(Any, buf.numpy())).cast("B")


def peak_rss() -> int:
    """This process's peak RSS in bytes (``VmHWM``). Not ``ru_maxrss``: a spawned rank's carries
    its parent's RSS at the fork (Linux keeps it across exec), the S3 server's included."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not in /proc/self/status")


def record(opts: dict[str, Any], **stats: Any) -> None:
    """This rank's fetch figures and its peak RSS so far, for the bench to collect after the run."""
    path = Path(opts["stats_dir"]) / f"{dist.get_rank()}.json"
    path.write_text(json.dumps({**stats, "peak_rss": peak_rss()}))


def _remote(opts: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return opts["remote_url"], dict(opts["remote_options"])


class _Loaded(nn.Module):
    """What a ceiling returns to the runner: no parameters, the bytes it read kept alive until then."""

    def __init__(self, buf: torch.Tensor) -> None:
        super().__init__()
        self.buf = buf


def ceiling(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """Each rank reads its 1/N share of the safetensors objects' bytes with obstore: ``RANGE_BYTES``
    ranged GETs, ``IN_FLIGHT`` at a time, copied into one preallocated buffer. No model: the
    endpoint's aggregate read rate across the ranks, which no load can beat."""
    store, remote = object_store(*_remote(opts))
    parts = rank_share(list_objects(store, remote, ".safetensors"), dist.get_rank(), dist.get_world_size())
    buf, view = _buffer(parts)
    asyncio.run(_pump(parts, obstore_get(store), read_into(view), IN_FLIGHT))
    record(opts, bytes=sum(p.end - p.start for p in parts), requests=len(parts) + 1)
    return _Loaded(buf)


def read_once(url: str, options: dict[str, Any]) -> int:
    """Reads every object under ``url`` once and drops the bytes (``IN_FLIGHT`` ranged GETs): the
    endpoint warmed before the first timed run, as it is for every later one. Returns the bytes."""
    store, remote = object_store(url, options)
    parts = whole_objects(list_objects(store, remote))
    asyncio.run(_pump(parts, obstore_get(store), lambda part, data: None, IN_FLIGHT))
    return sum(p.end - p.start for p in parts)


def _s3fs_options(options: dict[str, Any]) -> dict[str, Any]:
    """obstore's storage options as s3fs's ``S3FileSystem`` keywords."""
    kw: dict[str, Any] = {"key": options.get("access_key_id"), "secret": options.get("secret_access_key")}
    if options.get("endpoint"):
        kw["endpoint_url"] = options["endpoint"]
    if options.get("region"):
        kw["client_kwargs"] = {"region_name": options["region"]}
    return kw


def ceiling_s3fs(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """``ceiling`` with s3fs (aiobotocore) in place of obstore: the same share, ranges, lanes and
    buffer; the two set side by side are what the loader's choice of client rests on."""
    from s3fs import S3FileSystem

    url, options = _remote(opts)
    store, remote = object_store(url, options)
    parts = rank_share(list_objects(store, remote, ".safetensors"), dist.get_rank(), dist.get_world_size())
    buf, view = _buffer(parts)

    async def read() -> None:
        fs = S3FileSystem(asynchronous=True, **_s3fs_options(options))
        session = await fs.set_session()

        def fetch(part: Part) -> Awaitable[Any]:
            return fs._cat_file(f"{remote.bucket}/{part.path}", start=part.start, end=part.end)

        try:
            await _pump(parts, fetch, read_into(view), IN_FLIGHT)
        finally:
            await session.close()

    asyncio.run(read())
    record(opts, bytes=sum(p.end - p.start for p in parts), requests=len(parts) + 1)
    return _Loaded(buf)


def _streamload(
    readers: str, **settings: Any
) -> Callable[[str, Any, torch.dtype, dict[str, Any]], nn.Module]:
    """``streamload.from_pretrained(s3 url, readers=readers, storage_options=...)`` on every rank;
    ``settings``: streamload's own storage options on top of the endpoint's."""

    def load(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
        import streamload

        url, options = _remote(opts)
        options.update(settings)
        model = streamload.from_pretrained(
            url,
            device_mesh=mesh,
            dtype=dtype,
            progress=False,
            readers=readers,
            storage_options=options,
            **_load_kw(opts),
        )
        report = getattr(model, "streamload_report", None)
        record(
            opts,
            bytes=getattr(report, "remote_bytes", None),
            requests=getattr(report, "remote_requests", None),
            retries=getattr(report, "remote_retries", None),
        )
        return model

    return load


def download_then_load(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """Every rank downloads every object to a directory of its own (as every node would), with
    ``IN_FLIGHT`` ranged GETs of ``RANGE_BYTES`` written in place with pwrite, then loads it with
    streamload's local ``from_pretrained`` (``readers="auto"``); the directory is removed after."""
    import streamload

    store, remote = object_store(*_remote(opts))
    objects = list_objects(store, remote)
    prefix = remote.prefix + "/" if remote.prefix else ""
    local = tempfile.mkdtemp(prefix=f"streamload_remote_dl_r{dist.get_rank()}_")
    fds: dict[str, int] = {}
    try:
        for key, size in objects:
            dest = os.path.join(local, key.removeprefix(prefix))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fds[key] = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fds[key], size)
        parts = whole_objects(objects)

        def sink(part: Part, data: memoryview) -> None:
            os.pwrite(fds[part.path], data, part.dest)

        asyncio.run(_pump(parts, obstore_get(store), sink, IN_FLIGHT))
        for fd in fds.values():
            os.close(fd)
        fds.clear()
        model = streamload.from_pretrained(
            local, device_mesh=mesh, dtype=dtype, progress=False, readers="auto", **_load_kw(opts)
        )
    finally:
        for fd in fds.values():
            os.close(fd)
        shutil.rmtree(local, ignore_errors=True)  # mapped shards keep their pages
    record(opts, bytes=sum(n for _, n in objects), requests=len(parts) + 1)
    return model


RUNAI_ENV = {"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "AWS_EC2_METADATA_DISABLED": "true"}


def model_state(
    hub: dict[str, torch.Tensor], keys: Iterable[str], ties: dict[str, str]
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's state-dict ``keys``: per-expert MoE weights
    (``experts.<e>.gate_proj/up_proj/down_proj.weight``) stacked into the fused ``experts.gate_up_proj``
    (gate and up concatenated per expert, as transformers' conversion does) and ``experts.down_proj``;
    a tied key (``ties``: alias -> canonical) the checkpoint leaves out takes its canonical's tensor.

    Raises:
        KeyError: a key the checkpoint has no tensor for.
    """
    fused = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        prefix, _, leaf = key.rpartition(".")
        if key in hub:
            out[key] = hub[key]
        elif prefix.endswith("experts") and leaf in fused:
            count = sum(
                1 for k in hub if k.startswith(prefix + ".") and k.endswith(f".{fused[leaf][0]}.weight")
            )
            per = [torch.cat([hub[f"{prefix}.{e}.{n}.weight"] for n in fused[leaf]]) for e in range(count)]
            out[key] = torch.stack(per)
        elif ties.get(key) in hub:
            out[key] = hub[ties[key]]
        else:
            raise KeyError(f"{key}: not in the checkpoint")
    return out


def _tie_aliases(model: nn.Module) -> dict[str, str]:
    """State-dict keys that name the same parameter as an earlier one: alias -> canonical."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.update({name: first[id(p)]} if id(p) in first else {})
        first.setdefault(id(p), name)
    return out


def _runai(every_rank: bool) -> Callable[[str, Any, torch.dtype, dict[str, Any]], nn.Module]:
    """The Run:ai Model Streamer (``SafetensorsStreamer``, S3 credentials and endpoint from the
    environment) streams every safetensors object; torch's ``set_model_state_dict`` with
    ``full_state_dict`` fills the FSDP2-sharded model. ``every_rank``: each rank streams the whole
    checkpoint and keeps its shards; else rank 0 streams and ``broadcast_from_rank0`` sends them.
    The config files come with the streamer's own ``pull_files``, as vLLM gets them."""

    def load(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
        from runai_model_streamer import SafetensorsStreamer, pull_files
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        os.environ.update({**opts["remote_env"], **RUNAI_ENV})
        url = opts["remote_url"]
        configs = tempfile.mkdtemp(prefix="streamload_remote_cfg_")
        try:
            pull_files(url, configs, allow_pattern=["*.json"])
            fetched = sum(p.stat().st_size for p in Path(configs).rglob("*") if p.is_file())
            model = _sharded_empty(configs, mesh, dtype)
        finally:
            shutil.rmtree(configs, ignore_errors=True)
        streams = every_rank or dist.get_rank() == 0
        state: dict[str, Any] = {}
        if streams:
            # One LIST, as the streamer's own list_safetensors, with the sizes: what it fetches.
            store, remote = object_store(url, opts["remote_options"])
            objects = list_objects(store, remote, ".safetensors")
            files = [f"{remote.scheme}://{remote.bucket}/{key}" for key, _ in objects]
            fetched += sum(n for _, n in objects)
            hub: dict[str, torch.Tensor] = {}
            with SafetensorsStreamer() as streamer:
                streamer.stream_files(files)
                for name, t in streamer.get_tensors():
                    hub[name] = t if t.dtype == dtype else t.to(dtype)
            state = model_state(hub, model.state_dict().keys(), _tie_aliases(model))
            del hub
        set_model_state_dict(
            model,
            state,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=not every_rank),
        )
        del state
        if hasattr(model, "tie_weights"):
            typing.cast(Any, model).tie_weights()
        record(opts, bytes=fetched)
        return model

    return load


def _imports(*modules: str) -> Callable[[], None]:
    """A strategy's warmup: its clients imported before the clock starts."""

    def warmup() -> None:
        import importlib

        for m in modules:
            importlib.import_module(m)

    return warmup


def _with_warmup(
    load: Callable[[str, Any, torch.dtype, dict[str, Any]], nn.Module], *modules: str
) -> Callable[[str, Any, torch.dtype, dict[str, Any]], nn.Module]:
    typing.cast(Any, load).warmup = _imports(*modules)
    return load


# By name, as ``strategy_fn("streamload.tools.bench.remote_strategies:<name>")`` finds them.
# Every strategy that builds the model imports accelerate (init_empty_weights) and transformers:
# warmed for all alike, as the object store clients are.
_MODEL = ("transformers", "accelerate", "torch.distributed.checkpoint")
streamload_src = _with_warmup(_streamload("src"), "streamload", "obstore", *_MODEL)
streamload_owners = _with_warmup(_streamload("owners"), "streamload", "obstore", *_MODEL)
# src with no gaps fetched ahead (gap_cache_bytes=0): what the gap cache buys, side by side.
streamload_src_no_gaps = _with_warmup(_streamload("src", gap_cache_bytes=0), "streamload", "obstore", *_MODEL)
runai = _with_warmup(_runai(every_rank=False), "runai_model_streamer", *_MODEL)
runai_every_rank = _with_warmup(_runai(every_rank=True), "runai_model_streamer", *_MODEL)
_with_warmup(ceiling, "obstore")
_with_warmup(ceiling_s3fs, "obstore", "s3fs")
_with_warmup(download_then_load, "obstore", "streamload", *_MODEL)

REMOTE_LOADERS = (
    "ceiling",
    "ceiling_s3fs",
    "streamload_src",
    "streamload_owners",
    "streamload_src_no_gaps",
    "runai",
    "runai_every_rank",
    "download_then_load",
)
