"""Memory and time of loading a tied dense checkpoint into FSDP2 shards:
streamload vs the rank-0 set_model_state_dict(broadcast_from_rank0=True)
way, side by side in one run, at two model sizes and 2 and 4 ranks.

    python benchmarks/bench_memory.py --sizes 0.75 1.5 --ranks 2 4 --out bench_out/memory

Overhead = peak of the ranks' anonymous memory over the baseline (their
RssAnon together, sampled) minus the loaded shards that are anonymous (shards
that are copy-on-write views of the files, as the reader's own can be on the
CPU, are page cache, not anonymous).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from streamload.load.prepare import DEFAULT_CPU_BUCKET_BYTES
from streamload.tools.bench.runner import run_strategy
from streamload.tools.bench.table import markdown_table, write_jsonl
from streamload.tools.synthetic import make_checkpoint, sized_config

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
    for gb in args.sizes:
        ckpt = ensure_checkpoint(root, gb)
        for ws in args.ranks:
            for strategy in args.strategies:
                r = run_strategy(strategy, ckpt, ws, bucket_bytes=bucket)
                rows.append({**r.to_dict(), "size": f"{gb:g} GB"})
                print(
                    f"{gb:g} GB ws={ws} {strategy}: {r.seconds:.2f}s overhead {r.overhead_bytes / MiB:.0f} MiB "
                    f"correct={r.correct} tie={r.tie_held} {'ok' if r.ok else 'FAILED: ' + str(r.error)}",
                    flush=True,
                )
    write_jsonl(Path(args.out) / "results.jsonl", rows)
    table = (
        f"bucket_bytes = {args.bucket_mib} MiB; overhead bound 4 x bucket + 512 MiB = {bound / MiB:.0f} MiB\n\n"
        + markdown_table(rows, ["size"])
    )
    print(table)
    (Path(args.out) / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
