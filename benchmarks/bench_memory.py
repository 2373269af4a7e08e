"""Memory and time of loading a tied dense checkpoint into FSDP2 shards:
streamload vs the rank-0 set_model_state_dict(broadcast_from_rank0=True)
way, side by side in one run, at two model sizes and 2 and 4 ranks.

    python benchmarks/bench_memory.py --sizes 0.75 1.5 --ranks 2 4 --out bench_out/memory

Overhead = system-wide peak of anonymous memory over the baseline (sampled
from /proc/meminfo) minus the loaded shards (one model's worth in total).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from streamload.bench.runner import run_strategy
from streamload.load import DEFAULT_CPU_BUCKET_BYTES
from streamload.synthetic import make_checkpoint, sized_config

MiB = 1 << 20


def ensure_checkpoint(root: Path, gb: float, model_type: str = "qwen2", **kw) -> str:
    path = root / f"{model_type}_{gb:g}gb"
    if not (path / "config.json").exists():
        make_checkpoint(
            path, model_type, config=sized_config(model_type, gb, tie=True, **kw), max_shard_size="1GB"
        )
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.75, 1.5])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--strategies", nargs="+", default=["streamload", "rank0_broadcast"])
    ap.add_argument("--bucket-mib", type=int, default=DEFAULT_CPU_BUCKET_BYTES // MiB)
    ap.add_argument("--ckpt-dir", default="/tmp/streamload_bench_ckpts")
    ap.add_argument("--out", default="bench_out/memory")
    args = ap.parse_args()
    root = Path(args.ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    bucket = args.bucket_mib * MiB
    bound = 4 * bucket + 512 * MiB
    rows = []
    with open(Path(args.out) / "results.jsonl", "w") as jf:
        for gb in args.sizes:
            ckpt = ensure_checkpoint(root, gb)
            for ws in args.ranks:
                for strategy in args.strategies:
                    r = run_strategy(strategy, ckpt, ws, bucket_bytes=bucket)
                    d = r.to_dict()
                    d["size_gb"] = gb
                    d.pop("timeline")
                    jf.write(json.dumps(d) + "\n")
                    rows.append(d)
                    status = "ok" if r.ok else f"FAILED: {r.error}"
                    print(
                        f"{gb:g} GB ws={ws} {strategy}: {r.seconds:.2f}s overhead {r.overhead_bytes / MiB:.0f} MiB "
                        f"correct={r.correct} tie={r.tie_held} {status}",
                        flush=True,
                    )
    lines = [
        f"bucket_bytes = {args.bucket_mib} MiB; overhead bound 4 x bucket + 512 MiB = {bound / MiB:.0f} MiB",
        "",
        "| size | ranks | strategy | load s | peak anon over baseline | overhead (minus shards) | "
        "time vs rank0_broadcast | correct | tie held |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in rows:
        base = next(
            (
                x
                for x in rows
                if x["size_gb"] == d["size_gb"]
                and x["world"] == d["world"]
                and x["strategy"] == "rank0_broadcast"
                and x["ok"]
            ),
            None,
        )
        ratio = f"{d['seconds'] / base['seconds']:.2f}x" if base and d["ok"] else "-"
        lines.append(
            f"| {d['size_gb']:g} GB | {d['world']} | {d['strategy']} | "
            f"{d['seconds']:.2f} | {d['peak_anon_over_baseline'] / MiB:.0f} MiB | {d['overhead_bytes'] / MiB:.0f} MiB | "
            f"{ratio} | {d['correct']} | {d['tie_held']} |"
            if d["ok"]
            else f"| {d['size_gb']:g} GB | {d['world']} | {d['strategy']} | failed: {d['error']} | | | | | |"
        )
    table = "\n".join(lines)
    print(table)
    (Path(args.out) / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
