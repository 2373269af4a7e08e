"""Shared by benchmarks/client_*.py: a client's own load path against streamload swapped
in, side by side in one run (strategies interleaved per repeat), medians with their spread.

Each run is a fresh gloo process group (streamload.tools.bench.runner.run_strategy): load
time is the slowest rank's, from the model build to the loaded sharded model; peak
anonymous memory is each rank's RssAnon over its own baseline, sampled every 10 ms;
bit-exact is every parameter and buffer against transformers' from_pretrained.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20


def make_dense(root: str, gb: float) -> str:
    """A tied dense qwen2 checkpoint of about ``gb`` GB (bf16), random weights."""
    from streamload.tools.synthetic import make_checkpoint, sized_config

    cfg = sized_config("qwen2", gb, tie=True)
    return str(
        make_checkpoint(Path(root) / f"qwen2_{gb}gb", "qwen2", config=cfg, seed=5, max_shard_size="200MB")
    )


def _spread(values: Sequence[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def run(client: str, strategies: Sequence[str], dtype: str, argv: Sequence[str] | None = None) -> list[str]:
    """Runs every strategy ``--repeat`` times at each ``--ranks`` and prints one Markdown row each.

    Args:
        client: the client's name, first column of the table.
        strategies: bench strategy names (the client's own first).
        dtype: parameter dtype the client loads into.
        argv: command line (default: sys.argv).

    Returns:
        The table's lines.
    """
    from streamload.tools.bench.runner import run_strategy

    p = argparse.ArgumentParser(description=__doc__)
    # sized_config counts the tied head twice: its smallest qwen2 (1 layer, hidden 2048, vocab
    # 32000) is "0.35 GB", 0.22 GB on disk; the table's header prints the size on disk.
    p.add_argument("--gb", type=float, default=0.35, help="sized_config's size (at least 0.35)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ckpt", default=None, help="an existing checkpoint instead of a generated one")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix=f"streamload_{client}_") as tmp:
        ckpt = args.ckpt or make_dense(tmp, args.gb)
        runs: dict[tuple[int, str], list[Any]] = {}
        for world in args.ranks:
            for i in range(args.repeat):
                for s in strategies:
                    # Verify once per (ranks, strategy): the check costs a from_pretrained.
                    r = run_strategy(s, ckpt, world, dtype=dtype, verify=i == 0)
                    if not r.ok:
                        raise SystemExit(f"{s} at {world} ranks failed: {r.error}")
                    runs.setdefault((world, s), []).append(r)
                    print(f"# {s} ranks={world} repeat={i}: {r.seconds:.2f} s", flush=True)
        lines = [
            "| client | ranks | path | load s, median (min-max) | peak anon rank 0 MiB | "
            "peak anon other ranks MiB (max of ranks) | bit-exact | tie held |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (world, s), rs in runs.items():
            rank0 = [r.peak_anon_per_rank[0] / MiB for r in rs]
            others = [max(r.peak_anon_per_rank[1:]) / MiB for r in rs]
            lines.append(
                f"| {client} | {world} | {s} | {_spread([r.seconds for r in rs], '{:.2f}')} | "
                f"{_spread(rank0, '{:.0f}')} | {_spread(others, '{:.0f}')} | "
                f"{'yes' if rs[0].correct else 'no: ' + ', '.join(rs[0].mismatched[:3])} | {rs[0].tie_held} |"
            )
        size = sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors")) / 1e9
    print(f"\n{client}: qwen2, {size:.2f} GB on disk, dtype {dtype}, medians of {args.repeat} (min-max)\n")
    print("\n".join(lines))
    return lines
