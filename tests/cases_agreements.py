"""Multi-rank cases for tests/test_agreements.py: steps that ran on one rank outside an
agreement, each a hang (or ranks disagreeing on the outcome) when it failed there."""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace
from typing import Any

import streamload


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def case_sharded_full_state(rank: int, world: int, *, ckpt: str, entry: str) -> dict:
    """Rank 0 hands the model's own sharded state dict (DTensors) over as the full state.

    Returns what this rank raised, the tensor it names, its message and how long it took.
    """
    mesh = _mesh(world)
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, progress=False)
    sharded = model.state_dict()  # DTensor values: not a full state
    assert any(hasattr(v, "full_tensor") for v in sharded.values())
    full: Any = sharded if rank == 0 else {}
    t0 = time.perf_counter()
    try:
        if entry == "verl":
            streamload.fsdp2_load_full_state_dict(model, full, mesh)
        elif entry == "areal":
            streamload.areal_fsdp2_load_full_state_dict(model, full, None, tie_word_embeddings=True)
        elif entry == "accelerate":
            accelerator = SimpleNamespace(is_main_process=rank == 0)
            streamload.accelerate_fsdp2_load_full_state_dict(accelerator, model, full)
        else:
            streamload.load_checkpoint(model, full if rank == 0 else None, device_mesh=mesh, progress=False)
    except streamload.StreamloadError as exc:
        return {
            "raised": type(exc).__name__,
            "tensor": exc.tensor,
            "message": str(exc),
            "seconds": time.perf_counter() - t0,
            "keys": sorted(sharded),
        }
    raise AssertionError("no error for a sharded full state")


def case_load_beside_special_files(rank: int, world: int, *, ckpt: str, nul_rank: int | None) -> dict:
    """``readers="auto"`` over a directory that holds a FIFO named ``*.safetensors`` (not
    in the index), and, on ``nul_rank``, a path with a NUL byte (that rank does not read).

    Returns the reader choice and every parameter's checksum.
    """
    path = ckpt if rank != nul_rank else ckpt + "\0/elsewhere"
    model = streamload.from_pretrained(path, device_mesh=_mesh(world), bucket_bytes=4096, progress=False)
    report = model.streamload_report
    return {
        "reader": report.reader,
        "sums": {n: float(p.full_tensor().double().sum()) for n, p in model.named_parameters()},
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def case_eviction_fails_on_one_rank(rank: int, world: int, *, ckpt: str, failing: int) -> dict:
    """``drop_cache`` with mapped reads (every rank reads its own shards): eviction after the
    load fails on rank ``failing``. The load stands on every rank; that rank logs a warning.
    """
    import streamload.load.finalize as finalize

    real = finalize.evict

    def evict(paths: Any) -> None:
        raise OSError(f"injected: eviction refused on rank {rank}")

    records = _Records()
    logging.getLogger("streamload").addHandler(records)
    if rank == failing:
        finalize.evict = evict
    try:
        model = streamload.from_pretrained(
            ckpt,
            device_mesh=_mesh(world),
            progress=False,
            readers="owners",
            read_mode="mmap",
            drop_cache=True,
        )
    finally:
        finalize.evict = real
        logging.getLogger("streamload").removeHandler(records)
    return {
        "read_mode": model.streamload_report.read_mode,
        "warned": [m for m in records.messages if "could not be evicted" in m],
        "pid": os.getpid(),
    }
