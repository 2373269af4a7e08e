"""LoadReport: what a load did, in numbers."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from .options import env_flag


@dataclass
class LoadReport:
    """Figures of one load, the same on every rank except where noted.

    Attributes:
        bytes_read: checkpoint bytes the reader copied (reader rank; 0 elsewhere).
        bytes_mapped: bytes of this rank's shards that are copy-on-write views
            of the files (CPU; see ``map_files``), read when first touched.
        bytes_sent: bytes sent to ranks other than the reader.
        payload_bytes: bytes delivered to all ranks (the reader's own included).
        seconds: wall time of the whole call on this rank (``from_pretrained``: its model build
            and sharding included).
        gbps: payload_bytes / seconds / 1e9.
        buckets: collectives issued.
        bucket_bytes: configured bucket size.
        slots: staging slots asked for (buckets in flight); a CPU ``src`` or ``node`` reader
            whose next bucket's reads land in its slot (cold, buffered: ``Packer.lands_ahead``)
            holds one more (``peak_staging_bytes`` counts it).
        peak_staging_bytes: the most bytes the reader's staging ring held.
        staging: how this rank's host staging slots were held (GPU loads that stage: the reader,
            every rank under ``owners``): "pinned" (page-locked, copied to the device
            asynchronously), "pageable" (page-locking was refused - a memlock limit, a sandboxed
            GPU runtime -: plain memory, each copy synchronous, slower; a warning says why), or
            "" (nothing staged on this rank).
        bytes_received: bytes each rank received, by rank.
        missing_keys / unexpected_keys: as matched (non-empty only with strict=False).
        tie_groups: [canonical, alias, ...] per group, re-bound on every rank.
        tie_conflicts: aliases whose checkpoint values differ from the canonical.
        converted: targets built by fusing/converting checkpoint tensors.
        unrestored_buffers: non-persistent buffers that could not be recomputed.
        reader: reader mode and why it was chosen.
        read_mode: how this rank read the files ("mmap", "pread", "cold", or "remote" for object
            storage; "" where it read none).
        disk_bytes_read / disk_reads: bytes and read windows of this rank's cold reads
            (read_mode "cold"), short gaps included (O_DIRECT: alignment too); buffered ones may
            have found some pages cached. 0 where the files were read through a mapping.
        remote_bytes / remote_requests / remote_retries: for a checkpoint in object storage, what
            this rank fetched (headers and gaps between coalesced spans included), its requests and
            how many of them were retries; 0 where it read none.
        phases: where this rank's time went, in seconds. Top-level phases (no dot) run one after
            another and add up to ``seconds``: ``setup``, ``build``, ``shard``, ``agree_build``
            (``from_pretrained`` only: group and mesh, model on meta, ``shard_fn``, its agreement);
            ``state`` (tie groups recorded), ``open`` (the reader opens the files and broadcasts the
            table), ``readers`` (files' identities and fingerprints, all-gathered: the reader
            choice), ``match`` (conversion mapping and key matching), ``materialize`` (``to_empty``,
            buffers, ties), ``layout`` (placements and their digest), ``open_own`` (a rank reading
            its own shards opens its files: page-cache residency check, headers), ``agree_layout``,
            ``plan``, ``map`` (mapped views, fallback sources), ``strategy_open``, ``agree_plan``,
            ``stream`` (the copy), ``close``, ``ties``, ``agree_final``, ``finalize``. Dotted ones
            break a phase down: ``open.files``, ``open.config``, ``open.broadcast``, and the
            stream's steps ("stream.setup" (packer, transport, staging), "stream.agree_buffers" and
            "stream.agree_end" (the stream's first and last agreements), "stream.pack",
            "stream.cold_wait", "stream.cold_copy",
            "stream.cold_read" (read time summed over the read lanes), "stream.scatter_wait",
            "stream.unpack", "stream.status"; see ``streamload.timeline``).
    """

    bytes_read: int = 0
    bytes_mapped: int = 0
    bytes_sent: int = 0
    payload_bytes: int = 0
    seconds: float = 0.0
    gbps: float = 0.0
    buckets: int = 0
    bucket_bytes: int = 0
    slots: int = 0
    peak_staging_bytes: int = 0
    staging: str = ""
    bytes_received: list[int] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    tie_groups: list[list[str]] = field(default_factory=list)
    tie_conflicts: list[str] = field(default_factory=list)
    converted: dict[str, str] = field(default_factory=dict)
    unrestored_buffers: list[str] = field(default_factory=list)
    reader: str = "src"
    read_mode: str = ""
    disk_bytes_read: int = 0
    disk_reads: int = 0
    remote_bytes: int = 0
    remote_requests: int = 0
    remote_retries: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per stage on this rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def progress_enabled(progress: bool | None) -> bool:
    """``progress`` when given; else STREAMLOAD_PROGRESS=0/1; else only on a TTY."""
    chosen = env_flag("progress", progress)
    return sys.stderr.isatty() if chosen is None else chosen
