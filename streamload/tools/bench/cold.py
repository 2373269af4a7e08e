"""`streamload bench --cold`: every strategy starts from a cold page cache.

Before each strategy the checkpoint's pages are dropped (POSIX_FADV_DONTNEED,
dirty pages written back first) and ``mincore`` checks that they are gone;
the disk's sequential read bandwidth is measured in the same run (large
blocks, several in flight, O_DIRECT where the file system allows it), so each
cold load time can be set against the time to read the files once. So is one
buffered stream's (the kernel reading ahead), which on some disks (a VM's
virtual disk backed by the host's page cache) reads faster than O_DIRECT."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...io import cold
from .table import baseline_row, render_table

MiB = 1 << 20


def checkpoint_files(ckpt: str) -> list[str]:
    """Every regular file of the checkpoint (weights, index, config)."""
    root = Path(ckpt)
    return sorted(str(p) for p in (root.iterdir() if root.is_dir() else [root]) if p.is_file())


def weight_files(ckpt: str) -> list[str]:
    return [p for p in checkpoint_files(ckpt) if p.endswith(".safetensors")]


def make_cold(ckpt: str) -> float:
    """Drops the checkpoint from the page cache; returns the fraction of its
    weight pages still resident (mincore), which should be 0."""
    cold.evict(checkpoint_files(ckpt))
    return cold.residency(weight_files(ckpt))


def disk_bandwidth(ckpt: str, buffered: bool = False) -> cold.Bandwidth:
    """Reads the weight files once (cold, large blocks, O_DIRECT where possible;
    ``buffered``: one buffered stream in file order, which the kernel reads ahead of)."""
    make_cold(ckpt)
    files = weight_files(ckpt)
    bw = cold.probe_bandwidth(files, threads=1, direct="off") if buffered else cold.probe_bandwidth(files)
    make_cold(ckpt)
    return bw


def median_rows(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median cold time (load + first touch) of repeated runs of
    one strategy, with the spread of its times; failed runs are kept only if all failed."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return dict(runs[0])
    key = [r["seconds"] + r.get("touch_seconds", 0.0) for r in ok]
    order = sorted(range(len(ok)), key=lambda i: key[i])
    row = dict(ok[order[(len(ok) - 1) // 2]])
    row["repeats"] = len(ok)
    row["cold_seconds_all"] = [round(key[i], 3) for i in order]
    row["disk_gbps_all"] = [round(r.get("disk_gbps", 0.0), 3) for r in ok]
    row["disk_gbps"] = statistics.median(r.get("disk_gbps", 0.0) for r in ok)
    row["buffered_gbps"] = statistics.median(r.get("buffered_gbps", 0.0) for r in ok)
    verified = [r for r in runs if r.get("correct") is not None]
    if verified:
        row["correct"] = all(r["correct"] for r in verified)
    return row


def cold_table(
    rows: Sequence[dict[str, Any]], group_keys: Sequence[str], baseline: str = "rank0_broadcast"
) -> str:
    """One line per strategy: cold load time (median of the repeats, with their
    range), first touch, their sum against the time to read the files once at
    the disk bandwidth measured in the same run, and against ``baseline``."""
    head = [
        *group_keys,
        "ranks",
        "strategy",
        "cold load s",
        "first touch s",
        "load + touch s (min-max)",
        "read files once s",
        "vs read once",
        "one buffered stream s",
        "vs " + baseline,
        "resident before",
        "correct",
        "tie held",
    ]

    def cells(d: dict[str, Any]) -> list[str]:
        total = d["seconds"] + d.get("touch_seconds", 0.0)
        spread = d.get("cold_seconds_all") or [total]
        once = d["file_bytes"] / (d["disk_gbps"] * 1e9) if d.get("disk_gbps") else 0.0
        stream = d["file_bytes"] / (d["buffered_gbps"] * 1e9) if d.get("buffered_gbps") else 0.0
        base = baseline_row(rows, d, baseline, group_keys)
        base_total = base["seconds"] + base.get("touch_seconds", 0.0) if base else 0.0
        return [
            f"{d['seconds']:.2f}",
            f"{d.get('touch_seconds', 0.0):.2f}",
            f"{total:.2f} ({min(spread):.2f}-{max(spread):.2f})",
            f"{once:.2f} ({d.get('disk_gbps', 0.0):.2f} GB/s)",
            f"{total / once:.2f}x" if once else "-",
            f"{stream:.2f} ({total / stream:.2f}x)" if stream else "-",
            f"{total / base_total:.2f}x" if base_total else "-",
            f"{d.get('resident_before', 0.0):.1%}",
            str(d["correct"]),
            str(d["tie_held"]),
        ]

    return render_table(head, rows, group_keys, cells)
