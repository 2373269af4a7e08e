"""Finalize: re-tie aliases after the stream and build the LoadReport."""

from __future__ import annotations

import logging
import time

from ..io.cold import evict
from ..model.state import rebind_ties
from ..report import LoadReport
from ..transport.protocol import gather_or_raise
from ..transport.strategies import StreamResult
from .prepare import Prepared

log = logging.getLogger("streamload")


def _drop_cache(prep: Prepared) -> str:
    """Evicts the files this rank read when asked to (cold reads dropped them
    behind already); returns how it read them ("" where it read none)."""
    mode = str(getattr(prep.source, "read_mode", ""))
    if prep.options.drop_cache and mode and mode not in ("cold", "remote"):
        try:
            evict([f.path for f in getattr(prep.source, "files", [])])
        except Exception as exc:  # noqa: BLE001 - advisory, see below
            # After the last agreement: raising here on one rank would fail the load there
            # alone. Eviction only gives memory back to the host, so the load stands.
            log.warning("streamload: the checkpoint could not be evicted from the page cache: %s", exc)
    return mode


def finalize(prep: Prepared, result: StreamResult) -> LoadReport:
    """Re-binds ties on the filled model and reports what this load moved.

    Args:
        prep: the prepared load.
        result: what the reader strategy measured on this rank.

    Returns:
        This rank's LoadReport (``seconds`` and ``phases`` are completed by the driver).
    """
    error: BaseException | None = None
    try:
        rebind_ties(prep.model, prep.state.ties)
    except BaseException as exc:  # noqa: BLE001 - reported to every rank below, then re-raised
        error = exc
    prep.clock.mark("ties")
    plan, match, mapped = prep.plan, prep.match, prep.mapped
    seconds = time.perf_counter() - prep.clock.start
    received = [0] * plan.world_size
    for b in plan.buckets:
        for r, segs in enumerate(b.segments):
            received[r] += sum(s.nbytes for s in segs)
    # The last agreement: a re-tie that failed on one rank raises on every rank. It also
    # carries what each rank received: a plan covers this rank's node (or itself) only,
    # and in src mode the receivers' plans do not cover the other ranks.
    every = gather_or_raise(received[prep.plan_rank], error, prep.rank, prep.group, prep.device)
    prep.clock.mark("agree_final")
    if len(every) > 1:
        received = [int(n) for n in every]
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
    fetched = getattr(prep.source, "fetched", None)  # a checkpoint in object storage
    return LoadReport(
        remote_bytes=fetched.bytes if fetched else 0,
        remote_requests=fetched.requests if fetched else 0,
        remote_retries=fetched.retries if fetched else 0,
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
        staging=prep.shards.staging,
        bytes_received=received,
        missing_keys=match.missing,
        unexpected_keys=match.unexpected,
        tie_groups=[[g.canonical, *g.aliases] for g in prep.state.ties],
        tie_conflicts=prep.meta.tie_conflicts,
        converted=match.converted,
        unrestored_buffers=prep.unrestored,
        reader=f"{prep.choice.mode.value}: {prep.choice.reason}",
        read_mode=_drop_cache(prep),
        phases=dict(prep.clock.phases),
    )
