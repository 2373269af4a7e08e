"""Markdown tables and JSON lines for benchmark results."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({k: v for k, v in row.items() if k != "timeline"}) + "\n")


def median_of(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from repeated runs of one strategy: the median run's figures
    (by load time), with the median and the min-max spread of each timing.

    Args:
        runs: RunResult dicts of the same strategy, ranks and checkpoint.

    Returns:
        A row for ``markdown_table``; ``runs`` and ``*_spread`` say how many and how far apart.

    Example:
        >>> row = median_of([r1.to_dict(), r2.to_dict(), r3.to_dict()])
    """
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return dict(runs[0])
    ordered = sorted(ok, key=lambda r: r["seconds"])
    row = dict(ordered[len(ordered) // 2])
    for key in (
        "seconds",
        "touch_seconds",
        "first_step_seconds",
        "overhead_bytes",
        "peak_anon_over_baseline",
    ):
        values = sorted(r.get(key, 0) for r in ok)
        n = len(values)
        row[key] = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
        row[key + "_spread"] = (values[0], values[-1])
    row["runs"] = len(ok)
    row["phases"] = median_phases([r.get("phases") or {} for r in ok])
    # The correctness pass runs on the first repeat only: the verified runs decide.
    verified = [r for r in runs if r.get("correct") is not None]
    row["correct"] = all(r["correct"] for r in verified) if verified else None
    return row


def median_phases(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """The median of each phase over repeated runs (a phase a run lacks counts as 0 s there),
    in the order the phases first appear.

    Example:
        >>> median_phases([{"open": 1.0}, {"open": 3.0}, {"open": 2.0, "stream": 1.0}])
        {'open': 2.0, 'stream': 0.0}
    """
    names: list[str] = []
    for phases in runs:
        names.extend(k for k in phases if k not in names)
    out = {}
    for k in names:
        values = sorted(p.get(k, 0.0) for p in runs)
        n = len(values)
        out[k] = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return out


def phase_table(rows: Sequence[dict[str, Any]]) -> str:
    """Where each strategy that reports phases (streamload's, the floors) spent rank 0's time:
    one line per phase (median over the repeats), one column per strategy and rank count. Top-level
    phases add up to the load (``LoadReport.phases``); dotted ones break their parent down and are
    indented. The last line is the sum of the top-level phases.

    Example:
        >>> print(phase_table(rows))  # rows from median_of
    """
    cols = [d for d in rows if d.get("ok") and d.get("phases")]
    if not cols:
        return ""
    names: list[str] = []
    for d in cols:
        names.extend(k for k in d["phases"] if k not in names)
    # Each breakdown right under its parent.
    top = [k for k in names if "." not in k]
    ordered = [x for k in top for x in [k, *(n for n in names if n.startswith(k + "."))]]
    ordered += [n for n in names if n not in ordered]
    head = ["phase (rank 0, median s)", *(f"{d['strategy']} ({d['world']} ranks)" for d in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in ordered:
        label = f"&nbsp;&nbsp;{k}" if "." in k else k
        lines.append("| " + " | ".join([label, *(f"{d['phases'].get(k, 0.0):.3f}" for d in cols)]) + " |")
    sums = [sum(v for k, v in d["phases"].items() if "." not in k) for d in cols]
    lines.append("| " + " | ".join(["sum of phases", *(f"{v:.3f}" for v in sums)]) + " |")
    return "\n".join(lines)


def _vs_floors(rows: Sequence[dict[str, Any]], d: dict[str, Any], key: str, group_keys: Sequence[str]) -> str:
    """``d[key]`` as a ratio to each floor's in its group (``-`` where not measured)."""
    from .strategies import FLOORS  # here: the table's other users need no torch

    out = []
    for floor in FLOORS:
        base = baseline_row(rows, d, floor, group_keys)
        out.append(f"{d[key] / base[key]:.2f}x" if base and base.get(key) else "-")
    return " / ".join(out)


def _timing(d: dict[str, Any], key: str) -> str:
    spread = d.get(key + "_spread")
    if not spread or d.get("runs", 1) < 2:
        return f"{d.get(key, 0.0):.2f}"
    return f"{d[key]:.2f} ({spread[0]:.2f}-{spread[1]:.2f})"


def _first_line(error: str | None) -> str:
    """A failure's gist for a table cell: its last line that names an error, else its first."""
    lines = [ln.strip() for ln in (error or "").splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error:" in ln or "Exception:" in ln]
    text = (named[-1] if named else lines[0] if lines else "").replace("|", "/")
    return text[:200]


def markdown_table(
    rows: Sequence[dict[str, Any]], group_keys: Sequence[str], baseline: str = "rank0_broadcast"
) -> str:
    """One line per run; time and overhead ratios against ``baseline`` in the same group."""
    from .strategies import FLOORS  # here: the table's other users need no torch

    head = [
        *group_keys,
        "ranks",
        "strategy",
        "load s",
        "first touch s",
        "first step s",
        "shards file-backed",
        "peak anon over baseline",
        "overhead (minus anon shards)",
        "time vs " + baseline,
        "overhead vs " + baseline,
        "correct",
        "tie held",
        f"load vs {' / '.join(FLOORS)}",
        f"first step vs {' / '.join(FLOORS)}",
    ]

    def cells(d: dict[str, Any]) -> list[str]:
        base = baseline_row(rows, d, baseline, group_keys)
        t_ratio = f"{d['seconds'] / base['seconds']:.2f}x" if base else "-"
        m_ratio = (
            f"{d['overhead_bytes'] / base['overhead_bytes']:.2f}x"
            if base and base["overhead_bytes"] > 0
            else "-"
        )
        return [
            _timing(d, "seconds"),
            f"{d.get('touch_seconds', 0.0):.2f}",
            _timing(d, "first_step_seconds"),
            f"{d.get('file_backed_shard_bytes', 0) / MiB:.0f} MiB",
            f"{d['peak_anon_over_baseline'] / MiB:.0f} MiB",
            f"{d['overhead_bytes'] / MiB:.0f} MiB",
            t_ratio,
            m_ratio,
            str(d["correct"]),
            str(d["tie_held"]),
            _vs_floors(rows, d, "seconds", group_keys),
            _vs_floors(rows, d, "first_step_seconds", group_keys),
        ]

    return render_table(head, rows, group_keys, cells)


def baseline_row(
    rows: Sequence[dict[str, Any]], d: dict[str, Any], baseline: str, group_keys: Sequence[str]
) -> dict[str, Any] | None:
    """The ``baseline`` strategy's successful row in ``d``'s group (same ranks and group keys), if any."""
    return next(
        (
            x
            for x in rows
            if x["strategy"] == baseline
            and x["ok"]
            and x["world"] == d["world"]
            and all(x.get(k) == d.get(k) for k in group_keys)
        ),
        None,
    )


def failed_row(group: Sequence[str], d: dict[str, Any], width: int) -> str:
    """A table line for a failed run: its group, ranks, strategy and the error's one line."""
    cells = [*group, str(d["world"]), d["strategy"], f"failed: {_first_line(d.get('error'))}"]
    return "| " + " | ".join(cells + [""] * (width - len(cells))) + " |"


def render_table(
    head: Sequence[str],
    rows: Sequence[dict[str, Any]],
    group_keys: Sequence[str],
    cells: Callable[[dict[str, Any]], list[str]],
) -> str:
    """A Markdown table: a line per row — its group keys, ranks, strategy, then ``cells(row)``
    (or the error's one line for a failed run)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in rows:
        group = [str(d.get(k, "")) for k in group_keys]
        if not d["ok"]:
            lines.append(failed_row(group, d, len(head)))
            continue
        lines.append("| " + " | ".join([*group, str(d["world"]), d["strategy"], *cells(d)]) + " |")
    return "\n".join(lines)
