"""`streamload bench`: strategies side by side on one checkpoint."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .runner import run_strategy
from .strategies import STRATEGIES
from .table import markdown_table, median_of, write_jsonl

DEFAULT_STRATEGIES = [
    "streamload",
    "streamload_owners",
    "streamload_auto",
    "rank0_broadcast",
    "all_ranks",
    "accelerate_efficient",
    "dcp_hf",
    "hf_native",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint", nargs="?", help="checkpoint directory (omit to generate one with --model-type/--gb)"
    )
    p.add_argument(
        "--model-type", default="qwen2", help="for a generated checkpoint, e.g. qwen2 or qwen3_moe"
    )
    p.add_argument("--gb", type=float, default=0.1, help="size of a generated checkpoint")
    p.add_argument("--experts", type=int, default=64, help="experts per layer of a generated MoE checkpoint")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--strategies", nargs="+", default=DEFAULT_STRATEGIES, choices=sorted(STRATEGIES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bucket-mib", type=int, default=None)
    p.add_argument("--no-verify", action="store_true", help="skip the correctness pass")
    p.add_argument(
        "--repeat", type=int, default=1, help="runs per strategy; the table shows medians and min-max"
    )
    p.add_argument("--out", default="bench_out/bench")
    p.add_argument("--ckpt-dir", default="/tmp/streamload_bench_ckpts")


def run(args: argparse.Namespace) -> int:
    from ..synthetic import make_checkpoint, sized_config

    ckpt = args.checkpoint
    label = Path(ckpt).name if ckpt else f"{args.model_type}_{args.gb:g}gb"
    if ckpt is None:
        path = Path(args.ckpt_dir) / (label + (f"_{args.experts}e" if "moe" in args.model_type else ""))
        if not (path / "config.json").exists():
            kw = {"experts": args.experts} if "moe" in args.model_type else {}
            make_checkpoint(
                path, args.model_type, config=sized_config(args.model_type, args.gb, tie=True, **kw)
            )
        ckpt = str(path)
    os.makedirs(args.out, exist_ok=True)
    opts = {"bucket_bytes": args.bucket_mib << 20} if args.bucket_mib else {}
    rows = []
    for world in args.ranks:
        for strategy in args.strategies:
            for k in range(args.repeat):
                r = run_strategy(strategy, ckpt, world, dtype=args.dtype, verify=not args.no_verify, **opts)
                rows.append({**r.to_dict(), "label": label, "repeat": k})
                status = "ok" if r.ok else f"FAILED ({r.error})"
                print(
                    f"{label} ranks={world} {strategy} #{k}: {r.seconds:.2f}s, "
                    f"first step {r.first_step_seconds:.2f}s, overhead {r.overhead_bytes / 2**20:.0f} MiB, "
                    f"correct={r.correct}, tie held={r.tie_held}: {status}",
                    flush=True,
                )
    write_jsonl(Path(args.out) / "results.jsonl", rows)
    groups: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["world"], row["strategy"]), []).append(row)
    table = markdown_table([median_of(g) for g in groups.values()], ["label"])
    (Path(args.out) / "table.md").write_text(table + "\n")
    with open(Path(args.out) / "timelines.json", "w") as f:
        json.dump(
            [{k: r[k] for k in ("label", "world", "strategy", "timeline", "ok", "seconds")} for r in rows], f
        )
    from .plot import plot_timelines

    png = plot_timelines(
        [r for r in rows if r.get("repeat", 0) == 0], Path(args.out) / "memory.png", title=f"loading {label}"
    )
    print(table)
    print(f"wrote {Path(args.out) / 'results.jsonl'}, {Path(args.out) / 'table.md'}, {png}")
    return 0
