"""Cases for test_phases.py, run on every rank of a RankGroup."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import streamload
from streamload.timeline import top_level


def case_phases(rank: int, world: int, ckpt: str, readers: str) -> dict[str, Any]:
    """from_pretrained on every rank, timed from outside; the report's phases and the wall time."""
    dist.barrier()
    t0 = time.perf_counter()
    model = streamload.from_pretrained(ckpt, dtype=torch.float32, readers=readers, progress=False)
    wall = time.perf_counter() - t0
    rep = model.streamload_report
    return {"wall": wall, "seconds": rep.seconds, "phases": dict(rep.phases), "top": top_level(rep.phases)}


def case_residency_checks(rank: int, world: int, ckpt: str) -> int:
    """How many page-cache residency checks (mincore over the files) this rank ran in one load."""
    from streamload.io import cold

    calls = []
    measure = cold.residency

    def counted(paths: Any, *args: Any) -> float:
        calls.append(paths)
        return measure(paths, *args)

    cold.residency = counted
    try:
        model = streamload.from_pretrained(ckpt, dtype=torch.float32, readers="auto", progress=False)
    finally:
        cold.residency = measure
    assert model.streamload_report.reader.startswith("owners"), model.streamload_report.reader
    assert model.streamload_report.read_mode == "mmap"
    return len(calls)


def case_copy_threads(rank: int, world: int, ckpt: str) -> dict[str, list[int | None]]:
    """The copy threads of each source this rank opened in prepare ("opened"), and of each
    engine an already open source moved to ("moved": the reader, which opened its files before
    the choice, keeps them open and takes a new engine with its share)."""
    from streamload.io.checkpoint import Checkpoint
    from streamload.load import prepare

    got: dict[str, list[int | None]] = {"opened": [], "moved": []}
    open_source, use_threads = prepare.as_source, Checkpoint.use_threads

    def counted(path: Any, read_mode: str, n: int | None, *args: Any) -> Any:
        got["opened"].append(n)
        return open_source(path, read_mode, n, *args)

    def moved(self: Checkpoint, n: int) -> bool:
        got["moved"].append(n)
        assert use_threads(self, n) and self.engine.threads == n
        return True

    prepare.as_source = counted
    Checkpoint.use_threads = moved  # type: ignore[method-assign]
    try:
        model = streamload.from_pretrained(ckpt, dtype=torch.float32, readers="auto", progress=False)
    finally:
        prepare.as_source, Checkpoint.use_threads = open_source, use_threads  # type: ignore[method-assign]
    assert model.streamload_report.reader.startswith("owners"), model.streamload_report.reader
    return got
