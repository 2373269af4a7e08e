"""Cases run inside the rank group (see rank_group.py): a src load in which each rank records the
ranks it derived placements for."""

from __future__ import annotations

import cases_load
import torch.distributed as dist

import streamload.load.prepare as prepare


def case_src_places(rank: int, world: int, *, ckpt: str, ws: int, bucket_bytes: int) -> dict | None:
    """A bit-exact src load (cases_load.case_from_pretrained) with ``placement_for`` counted."""
    asked: set[int] = set()
    original = prepare.placement_for

    def counting(spec, r):  # type: ignore[no-untyped-def]
        asked.add(r)
        return original(spec, r)

    prepare.placement_for = counting
    try:
        out = cases_load.case_from_pretrained(
            rank, world, ckpt=ckpt, ws=ws, bucket_bytes=bucket_bytes, readers="src"
        )
    finally:
        prepare.placement_for = original
    if out is None:
        return None
    out["asked"] = sorted(asked)
    out["rank"] = dist.get_rank()
    return out
