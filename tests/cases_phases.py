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
