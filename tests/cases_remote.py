"""Cases run on every rank of a RankGroup for tests/test_remote_dist.py: checkpoints in a
loopback S3 endpoint, loaded by ranged GETs and compared bit for bit with transformers'
load of the same files from a local directory."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from cases_load import _same_config, compare_model, mesh_for, reference, tied

import streamload
from streamload.errors import StreamloadError
from streamload.io.remote import RemoteCheckpoint, as_remote


def _header_bytes(url: str, storage_options: dict[str, Any]) -> int:
    """Bytes one rank fetches to open the checkpoint (its headers), measured by opening it."""
    ckpt = RemoteCheckpoint(as_remote(url, storage_options))
    try:
        return ckpt.fetched.bytes
    finally:
        ckpt.fetcher.close()


def case_remote_load(
    rank: int,
    world: int,
    *,
    url: str,
    local: str,
    ws: int,
    readers: str,
    storage_options: dict[str, Any] | None,
    env: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 1 << 20,
) -> dict | None:
    """from_pretrained(url) on ``ws`` ranks against transformers on the local copy; returns this
    rank's report and the header bytes one open fetches."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        kw: dict[str, Any] = {} if storage_options is None else {"storage_options": storage_options}
        model = streamload.from_pretrained(
            url,
            device_mesh=mesh,
            dtype=dtype,
            bucket_bytes=bucket_bytes,
            progress=False,
            readers=readers,
            **kw,
        )
        headers = _header_bytes(url, storage_options or {})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ref = reference(local, dtype)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    assert tied(model) == tied(ref)
    # The config and generation config as transformers reads them from the local copy (its load
    # of a quantized checkpoint rewrites quantization_config: test_configs_read_as_transformers).
    if getattr(model.config, "quantization_config", None) is None:
        model.config._name_or_path = ref.config._name_or_path
        a, b = model.config.to_dict(), ref.config.to_dict()
        assert _same_config(model.config, ref.config), {
            k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)
        }
    assert model.generation_config.to_dict() == ref.generation_config.to_dict()
    rep = model.streamload_report
    assert rep.peak_staging_bytes <= rep.slots * rep.bucket_bytes
    return {"report": rep.to_dict(), "headers": headers}


def case_remote_fails(
    rank: int, world: int, *, url: str, ws: int, readers: str, storage_options: dict[str, Any]
) -> dict | None:
    """A load that must fail: the error each rank got (type, message, seconds)."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    t0 = time.perf_counter()
    try:
        streamload.from_pretrained(
            url, device_mesh=mesh, bucket_bytes=1 << 16, progress=False, readers=readers,
            storage_options=storage_options,
        )  # fmt: skip
    except StreamloadError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - t0}
    raise AssertionError("the load succeeded")


def case_remote_load_checkpoint(
    rank: int,
    world: int,
    *,
    url: str,
    local: str,
    ws: int,
    readers: str,
    storage_options: dict[str, Any],
    shard_dim: int = 0,
) -> dict | None:
    """load_checkpoint(model, url) into a meta model sharded on ``shard_dim`` (column shards read
    strided spans of each row range)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from streamload.integrations.pretrained import meta_model

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model = meta_model(local)
    model.tie_weights()  # transformers ties lazily: tie before sharding

    def placement(p: torch.nn.Parameter) -> Shard:
        ok = p.ndim > shard_dim and p.shape[shard_dim] % ws == 0  # FSDP2 shards dims > 0 only evenly
        return Shard(shard_dim) if ok else Shard(0)

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    report = streamload.load_checkpoint(
        model, url, device_mesh=mesh, readers=readers, bucket_bytes=1 << 16, progress=False,
        storage_options=storage_options,
    )  # fmt: skip
    bad = compare_model(model, reference(local, None))
    assert not bad, f"differ from transformers: {bad}"
    return report.to_dict()


def case_other_version_on_open(
    rank: int, world: int, *, url: str, local: str, readers: str, storage_options: dict[str, Any]
) -> dict | None:
    """Ranks other than the reader find other versions of the objects when they open them for
    their own reads (a new upload between the reader's open and theirs, simulated by the ETag
    their open sees): they must not read them; the reader alone reads the versions its table
    describes, and the load is bit-exact."""
    import dataclasses

    from streamload.io import remote

    real = remote._open_file
    if rank != 0:

        async def newer(*args: Any, **kw: Any) -> Any:
            return dataclasses.replace(await real(*args, **kw), etag='"a-newer-upload"')

        remote._open_file = newer  # type: ignore[assignment]
    try:
        model = streamload.from_pretrained(
            url, device_mesh=mesh_for(world), progress=False, readers=readers, storage_options=storage_options,
            node=str(rank),  # each rank its own node: in node mode too, every rank opens the objects
        )  # fmt: skip
    finally:
        remote._open_file = real  # type: ignore[assignment]
    bad = compare_model(model, reference(local, None))
    assert not bad, f"differ from transformers: {bad}"
    rep = model.streamload_report
    return {"reader": rep.reader, "remote_bytes": rep.remote_bytes}


def case_identity_asks(
    rank: int, world: int, *, url: str, readers: str, storage_options: dict[str, Any], no_thread: bool = False
) -> list[str]:
    """The threads this rank asked the object store for its view of the objects on (the reader
    choice compares views): the reader takes the objects it opened, the others ask on a helper
    thread while the reader opens them, and a src load asks nothing. ``no_thread``: starting the
    helper fails (``Thread.start``'s "can't start new thread"): the rank asks on its own thread."""
    import threading

    from streamload.io import remote
    from streamload.load import source
    from streamload.transport import readers as readers_mod

    asked: list[str] = []
    real, soon = remote.remote_identity, source.identity_soon

    def counted(path: Any) -> Any:
        asked.append(threading.current_thread().name)
        return real(path)

    def refused(path: Any) -> Any:
        raise RuntimeError("can't start new thread")

    remote.remote_identity = readers_mod.remote_identity = counted  # type: ignore[assignment]
    if no_thread:
        source.identity_soon = refused  # type: ignore[assignment]
    try:
        model = streamload.from_pretrained(
            url, device_mesh=mesh_for(world), progress=False, readers=readers, storage_options=storage_options
        )
    finally:
        remote.remote_identity = readers_mod.remote_identity = real  # type: ignore[assignment]
        source.identity_soon = soon  # type: ignore[assignment]
    assert model.streamload_report.reader.startswith("owners" if readers == "auto" else "src")
    return asked
