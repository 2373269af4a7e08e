"""Opening the checkpoint: the reader rank opens it and tells every rank its tensor table."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError, StreamloadError
from ..io.checkpoint import Checkpoint
from ..io.remote import RemotePath, identity_soon, opened_remote_identity
from ..io.sources import STATE_DICT, Source, as_source
from ..model.state import ModelState
from ..plan.convert import FALLBACK_PREFIX, Table
from ..timeline import PhaseClock
from ..transport.collectives import broadcast_object
from ..transport.protocol import portable

# Tied duplicates are compared this many bytes at a time: never a full copy.
_COMPARE_CHUNK = 64 << 20


@dataclass
class SourceMeta:
    """What the reader tells every rank before any weight moves."""

    table: Table
    tie_conflicts: list[str] = field(default_factory=list)
    path: str | None = None  # the checkpoint as the reader names it
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. config for from_pretrained
    # How the reader reads its files ("mmap", "pread", "cold"; "" for other sources): on its host,
    # ranks that read the very same files need not measure their page-cache residency again.
    read_mode: str = ""
    # For a checkpoint in object storage, (object, size, ETag) of every object the reader opened:
    # a rank that opens them too must find these very versions (never a mix of two uploads).
    objects: tuple | None = None
    # The reader's torch.initial_seed(): what every rank seeds the initialisation of missing
    # tensors with (model/missing.py), so all ranks draw the same values; no rank's RNG is used.
    init_seed: int | None = None


@dataclass
class OpenedSource:
    """A checkpoint already opened by ``open_source``: the source (reader only) and its meta."""

    source: Source | None
    meta: SourceMeta
    # A rank that does not read, on a checkpoint in object storage: its own view of the objects
    # (``remote_identity``), asked while the reader opened them (``readers`` other than src).
    identity: Future[tuple | None] | None = None


def compare_tied(ckpt: Source, state: ModelState) -> list[str]:
    """Aliases whose checkpoint bytes differ from their canonical tensor's.

    Args:
        ckpt: the open checkpoint.
        state: the model's recorded state (its tie groups).

    Returns:
        The alias names that conflict, compared a bounded chunk at a time.
    """
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


def check_full_state(state: Any) -> None:
    """Raises CheckpointError when a state dict given as the full state holds a DTensor.

    A sharded value (``model.state_dict()`` of an FSDP2 model) is not a full state: making
    it full is ``full_tensor()``, a collective the reader would enter alone, leaving every
    rank waiting until the process group's timeout. The check reads only types, so the
    reader raises before any collective and ``open_source`` brings the error to every rank.

    Args:
        state: what the reader was given (only a mapping is checked).
    """
    if not isinstance(state, Mapping):
        return
    from torch.distributed.tensor import DTensor

    sharded = [k for k, v in state.items() if isinstance(v, DTensor)]
    if sharded:
        raise CheckpointError(
            f"the full state dict holds {len(sharded)} DTensor values (a sharded state dict, e.g. "
            "model.state_dict() of an FSDP2 model); pass a full state dict, e.g. "
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), or call "
            "streamload.load_checkpoint with the checkpoint path",
            STATE_DICT,
            str(sharded[0]),
        )


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
    drop_cache: bool = False,
    direct_io: bool | None = None,
    clock: PhaseClock | None = None,
    ask_identity: bool = False,
) -> OpenedSource:
    """Collective: the reader opens the checkpoint and broadcasts its table (or its error).

    Args:
        path: what this rank was given (used on ``src_rank`` only).
        rank, src_rank: this rank and the reader, global ranks.
        state: the model's recorded state (tie conflicts are checked against it).
        extra: a dict, or a callable the reader runs, sent along with the table.
        clock: the load's phase clock: the reader's file opening (``open.files``: headers and
            the page-cache residency check) and the broadcast (``open.broadcast``) are timed.
        ask_identity: the reader choice will compare identities (``readers`` other than src):
            other ranks ask for theirs of an object store's checkpoint meanwhile.

    Returns:
        The source (on the reader; None elsewhere) and the meta every rank shares.
    """
    ckpt: Source | None = None
    payload: SourceMeta | BaseException | None = None
    local: BaseException | None = None
    identity = None
    if ask_identity and rank != src_rank and isinstance(path, RemotePath):
        try:
            identity = identity_soon(path)
        except Exception:  # noqa: BLE001 - no helper thread: asked on this one, in the reader choice
            identity = None
    if rank == src_rank:
        try:
            if path is None:
                raise StreamloadError("the reader rank was given no checkpoint", rank=rank)
            check_full_state(path)
            with clock.part("open.files") if clock else nullcontext():
                ckpt = as_source(path, read_mode, threads, drop_cache, direct_io)
            table = {t.name: (t.dtype, t.shape, t.file) for t in ckpt.tensors}
            payload = SourceMeta(
                table,
                tie_conflicts=compare_tied(ckpt, state),
                path=str(getattr(ckpt, "path", path)),
                extra=dict(extra() if callable(extra) else extra or {}),
                read_mode=str(getattr(ckpt, "read_mode", "")) if isinstance(ckpt, Checkpoint) else "",
                objects=opened_remote_identity(getattr(ckpt, "files", [])),
                init_seed=torch.initial_seed(),
            )
        except BaseException as exc:  # noqa: BLE001 - every rank must hear of it
            local = exc
            payload = portable(exc, rank)
    with clock.part("open.broadcast") if clock else nullcontext():
        payload = broadcast_object(
            payload, src_rank, group, device if device.type != "meta" else torch.device("cpu")
        )
    if local is not None:
        raise local
    if isinstance(payload, BaseException):
        raise payload
    assert isinstance(payload, SourceMeta)
    return OpenedSource(ckpt, payload, identity)


def check_same_table(ckpt: Source, table: Table) -> None:
    """A rank reading on its own must see the reader's tensor table exactly."""
    mine = {t.name: (t.dtype, tuple(t.shape)) for t in ckpt.tensors}
    theirs = {k: (v[0], tuple(v[1])) for k, v in table.items() if not k.startswith(FALLBACK_PREFIX)}
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:5]
        raise CheckpointError(
            f"this rank's checkpoint differs from the reader's: {diff}", str(getattr(ckpt, "path", ""))
        )
