"""`streamload bench --sync`: the trainer's weights into colocated vLLM engines after a step, four
ways side by side in one run (``sync_run.py``: streamload's ``sync_weights``, vLLM's
``ModuleSource``, save + ``reload_weights(weights_path=)``, and the one-collective floor), on a
dense and a per-expert MoE checkpoint, at each rank count.

The engine runs in the vLLM venv (``STREAMLOAD_VLLM_PYTHON``, default ``.venv-vllm`` at the
repository root: what ``.ci/run`` builds); this module only makes the checkpoints, starts that
interpreter and renders its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from .table import write_jsonl

ROOT = Path(__file__).resolve().parents[3]
MODELS: tuple[tuple[str, dict[str, Any]], ...] = (("qwen2", {}), ("qwen3_moe", {"experts": 64}))


def vllm_python() -> Path:
    """The vLLM venv's interpreter."""
    return Path(os.environ.get("STREAMLOAD_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def checkpoints(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, path) of the dense and the per-expert MoE checkpoint (made once, bf16, ``--gb``)."""
    from ..synthetic import make_checkpoint, sized_config

    out = []
    for mt, kw in MODELS:
        label = f"{mt}_{args.gb:g}gb" + (f"_{kw['experts']}e" if kw else "")
        path = Path(args.ckpt_dir) / label
        if not (path / "config.json").exists():
            make_checkpoint(path, mt, config=sized_config(mt, args.gb, tie=True, **kw))
        out.append((label, str(path)))
    return out


def run_sync(args: argparse.Namespace) -> int:
    """Runs every checkpoint at every rank count; writes results.jsonl and table.md to --out."""
    import streamload._streamload as native

    py = vllm_python()
    if not py.exists():
        raise SystemExit(f"no vLLM venv at {py} (bash .ci/run builds .venv-vllm; or STREAMLOAD_VLLM_PYTHON)")
    os.makedirs(args.out, exist_ok=True)
    env = {
        **os.environ,
        "STREAMLOAD_NATIVE": native.__file__,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    for k in ("VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(k, None)
    summary: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    repeat = max(1, args.repeat)
    for label, ckpt in checkpoints(args):
        for world in args.ranks:
            print(f"sync bench: {label} at {world} ranks, {repeat} repeats ...", flush=True)
            proc = subprocess.run(
                [str(py), str(Path(__file__).with_name("sync_run.py")), ckpt, str(world), str(repeat)],
                env=env,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0 or not proc.stdout.strip():
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
                raise SystemExit(f"sync bench failed for {label} at {world} ranks:\n{tail}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            for row in res["summary"]:
                summary.append({"label": label, **row})
                print("  " + _line(row), flush=True)
            raw.extend({"label": label, **r} for r in res["rows"])
    write_jsonl(Path(args.out) / "results.jsonl", summary)
    write_jsonl(Path(args.out) / "runs.jsonl", raw)
    table = sync_table(summary)
    (Path(args.out) / "table.md").write_text(table + "\n")
    print(table)
    print(f"wrote {Path(args.out) / 'results.jsonl'}, {Path(args.out) / 'table.md'}")
    return 0


def _rng(row: dict[str, Any], k: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    lo, hi = row[k + "_range"]
    return f"{fmt.format(row[k] / scale)} [{fmt.format(lo / scale)}-{fmt.format(hi / scale)}]"


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['way']}: {_rng(row, 'seconds')} s, assembly {_rng(row, 'assembly')} s, "
        f"transport {_rng(row, 'transport')} s, engine {_rng(row, 'engine')} s, "
        f"peak extra {_rng(row, 'peak_extra', 2**20, '{:.0f}')} MiB"
    )


def sync_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per checkpoint, rank count and way; medians [ranges] over the repeats,
    and the ratios the issue sets: to ModuleSource (whole syncs), to the floor (the floor has no
    engine, so a way's *delivery* - its sync less the engine's own load time - is set against
    it; the whole sync's ratio is beside it), and the assembly share of the sync."""
    head = (
        "| model | ranks | way | sync s | assembly s | transport s | engine load s | peak extra MiB / rank "
        "| vs ModuleSource | delivery vs floor (sync vs floor) | assembly share |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        same = [x for x in rows if x["label"] == r["label"] and x["world"] == r["world"]]
        floor = next(x for x in same if x["way"] == "floor")["seconds"]
        ms = next(x for x in same if x["way"] == "module_source")["seconds"]
        share = r["assembly"] / r["seconds"] if r["seconds"] else 0.0
        delivery = r["seconds"] - r["engine"]
        lines.append(
            f"| {r['label']} | {r['world']} | {r['way']} | {_rng(r, 'seconds')} | {_rng(r, 'assembly')} "
            f"| {_rng(r, 'transport')} | {_rng(r, 'engine')} | {_rng(r, 'peak_extra', 2**20, '{:.0f}')} "
            f"| {r['seconds'] / ms:.2f}x | {delivery / floor:.2f}x ({r['seconds'] / floor:.2f}x) | {share:.1%} |"
        )
    groups = {(r["label"], r["world"]): r for r in rows if r["way"] == "streamload"}
    notes = [
        f"- {label} at {world} ranks: {r['hub_bytes'] / 2**20:.0f} MiB per sync in {r['groups']} groups, "
        f"largest group {r['group_bytes'] / 2**20:.0f} MiB, at most {r.get('held_groups', 0)} group buffer(s) "
        f"alive at once on a rank, {r.get('kept_bytes', 0) / 2**20:.0f} MiB kept between syncs (in its peak extra)"
        for (label, world), r in groups.items()
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(notes)
