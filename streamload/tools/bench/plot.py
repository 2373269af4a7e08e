"""Memory-over-time plot: one line per strategy, one panel per rank count."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20


def plot_timelines(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Writes a PNG of system-wide anonymous memory over the baseline vs time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.get("label", ""), r["world"]) for r in rows if r.get("ok")})
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(6 * max(1, len(groups)), 4), squeeze=False)
    for ax, (label, world) in zip(axes[0], groups, strict=False):
        for r in rows:
            if not r.get("ok") or r["world"] != world or r.get("label", "") != label or not r.get("timeline"):
                continue
            t = [p[0] for p in r["timeline"]]
            m = [p[1] / MiB for p in r["timeline"]]
            ax.plot(t, m, label=f"{r['strategy']} ({r['seconds']:.1f}s, peak {max(m):.0f} MiB)")
        ax.set_title(f"{label} {world} ranks".strip())
        ax.set_xlabel("seconds since load start")
        ax.set_ylabel("anonymous memory over baseline (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
