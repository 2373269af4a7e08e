"""MoE checkpoints stored one tensor per expert (>= 1.5 GB, 4 ranks): load
time and anonymous-memory overhead of streamload (fused on the fly into each
rank's shard) vs transformers' from_pretrained on rank 0 followed by the
set_model_state_dict broadcast, side by side in one run, at 32, 64 and 128
experts per layer.

    python benchmarks/bench_moe.py --gb 1.5 --experts 32 64 128 --ranks 4 --out bench_out/moe
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from streamload.load.prepare import DEFAULT_CPU_BUCKET_BYTES
from streamload.tools.bench.runner import run_strategy
from streamload.tools.bench.table import MiB, markdown_table, write_jsonl
from streamload.tools.synthetic import make_checkpoint, sized_config


def ensure_moe(root: Path, gb: float, experts: int, model_type: str = "qwen3_moe") -> str:
    path = root / f"{model_type}_{gb:g}gb_{experts}e"
    if not (path / "config.json").exists():
        cfg = sized_config(
            model_type, gb, tie=True, experts=experts, expert_intermediate=max(64, 16384 // experts)
        )
        make_checkpoint(path, model_type, config=cfg, max_shard_size="1GB")
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--experts", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4])
    ap.add_argument("--strategies", nargs="+", default=["streamload", "rank0_broadcast"])
    ap.add_argument("--bucket-mib", type=int, default=DEFAULT_CPU_BUCKET_BYTES // MiB)
    ap.add_argument("--ckpt-dir", default="/tmp/streamload_bench_ckpts")
    ap.add_argument("--out", default="bench_out/moe")
    args = ap.parse_args()
    root = Path(args.ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for experts in args.experts:
        ckpt = ensure_moe(root, args.gb, experts)
        ntensors = sum(1 for _ in Path(ckpt).glob("*.safetensors"))
        for ws in args.ranks:
            for strategy in args.strategies:
                r = run_strategy(strategy, ckpt, ws, bucket_bytes=args.bucket_mib * MiB)
                d = {**r.to_dict(), "experts": experts, "files": ntensors}
                rows.append(d)
                print(
                    f"{experts} experts ws={ws} {strategy}: {r.seconds:.2f}s overhead "
                    f"{r.overhead_bytes / MiB:.0f} MiB correct={r.correct} tie={r.tie_held} "
                    f"{'ok' if r.ok else 'FAILED: ' + str(r.error)}",
                    flush=True,
                )
    write_jsonl(Path(args.out) / "results.jsonl", rows)
    table = (
        f"per-expert checkpoints of {args.gb:g} GB (qwen3_moe layout, tied), bucket {args.bucket_mib} MiB\n\n"
        + markdown_table(rows, ["experts"])
    )
    print(table)
    (Path(args.out) / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
