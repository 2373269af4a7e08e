"""Finalize: re-tie aliases after the stream and build the LoadReport."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from ..io.cold import evict
from ..model.state import rebind_ties
from ..report import LoadReport
from ..transport.readers import ReaderMode
from ..transport.strategies import StreamResult
from .prepare import Prepared

log = logging.getLogger("streamload")


def _drop_cache(prep: Prepared) -> str:
    """Evicts the files this rank read when asked to (cold reads dropped them
    behind already); returns how it read them ("" where it read none)."""
    mode = str(getattr(prep.source, "read_mode", ""))
    if prep.options.drop_cache and mode and mode != "cold":
        evict([f.path for f in getattr(prep.source, "files", [])])
    return mode


def finalize(prep: Prepared, result: StreamResult) -> LoadReport:
    """Re-binds ties on the filled model and reports what this load moved.

    Args:
        prep: the prepared load.
        result: what the reader strategy measured on this rank.

    Returns:
        This rank's LoadReport.
    """
    prep.clock.mark("stream")
    rebind_ties(prep.model, prep.state.ties)
    prep.clock.mark("finalize")
    plan, match, mapped = prep.plan, prep.match, prep.mapped
    seconds = time.perf_counter() - prep.clock.start
    received = [0] * plan.world_size
    for b in plan.buckets:
        for r, segs in enumerate(b.segments):
            received[r] += sum(s.nbytes for s in segs)
    world = dist.get_world_size(prep.group) if prep.group is not None else 1
    if world > 1 and (len(prep.served) != world or prep.choice.mode is ReaderMode.SRC):
        # The plan covers this rank's node (or itself) only: one integer per rank gives the rest.
        # In src mode the reader's plan covers every rank but its receivers' do not: all gather.
        mine = torch.tensor([received[prep.plan_rank]], dtype=torch.int64, device=prep.device)
        every = [torch.zeros(1, dtype=torch.int64, device=prep.device) for _ in range(world)]
        dist.all_gather(every, mine, group=prep.group)
        received = [int(x.item()) for x in every]
    payload = sum(received)
    readers_at = prep.choice.reader_ranks(prep.src_group_rank, len(received))
    if prep.group_rank == prep.src_group_rank:
        log.info(
            "streamload: %.2f GB in %.2f s (%d buckets; this rank read %.2f GB, mapped %.2f GB)",
            payload / 1e9,
            seconds,
            len(plan.buckets),
            result.bytes_read / 1e9,
            mapped.nbytes / 1e9,
        )
    return LoadReport(
        bytes_read=result.bytes_read,
        bytes_mapped=mapped.nbytes,
        bytes_sent=sum(n for r, n in enumerate(received) if r not in readers_at),
        payload_bytes=payload,
        seconds=seconds,
        gbps=payload / seconds / 1e9 if seconds > 0 else 0.0,
        buckets=len(plan.buckets),
        bucket_bytes=prep.bucket_bytes,
        slots=prep.options.slots,
        peak_staging_bytes=result.peak_staging_bytes,
        bytes_received=received,
        missing_keys=match.missing,
        unexpected_keys=match.unexpected,
        tie_groups=[[g.canonical, *g.aliases] for g in prep.state.ties],
        tie_conflicts=prep.meta.tie_conflicts,
        converted=match.converted,
        unrestored_buffers=prep.unrestored,
        reader=f"{prep.choice.mode.value}: {prep.choice.reason}",
        read_mode=_drop_cache(prep),
        phases=prep.clock.phases,
    )
