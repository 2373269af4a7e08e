"""Cold loads with buffered reads (the default) against O_DIRECT reads, interleaved.

One warm rank group per variant (``BenchGroup``: processes started once, the model's
modules imported before the clock starts), created with ``STREAMLOAD_DIRECT_IO`` set
to "0" (buffered) or "1" (O_DIRECT); the variants take turns within each repeat, so a
slow patch of the shared disk hits both. Before every load the checkpoint is evicted
and checked with mincore (``make_cold``). Prints each load, then per variant the median
load + first-touch seconds with min-max, and the ratio of the medians.

    python benchmarks/bench_direct_io.py CKPT --ranks 2 4 --repeat 6 --strategy streamload

``--strategy`` is a ``streamload bench`` strategy: ``streamload`` (src: rank 0 reads and
scatters) or ``streamload_owners`` (every rank reads its own shards).
"""

from __future__ import annotations

import argparse
import os
import statistics

from streamload.tools.bench.runner import BenchGroup

VARIANTS = {"buffered": "0", "o_direct": "1"}


def _groups(world: int) -> dict[str, BenchGroup]:
    groups = {}
    for name, value in VARIANTS.items():
        saved = os.environ.get("STREAMLOAD_DIRECT_IO")
        os.environ["STREAMLOAD_DIRECT_IO"] = value  # the spawned ranks inherit it
        try:
            groups[name] = BenchGroup(world)
        finally:
            if saved is None:
                os.environ.pop("STREAMLOAD_DIRECT_IO", None)
            else:
                os.environ["STREAMLOAD_DIRECT_IO"] = saved
    return groups


def run(ckpt: str, world: int, repeat: int, strategy: str) -> dict[str, list[float]]:
    """Interleaved cold loads; returns load + first-touch seconds per variant."""
    groups = _groups(world)
    out: dict[str, list[float]] = {name: [] for name in groups}
    try:
        for i in range(repeat):
            for name, group in groups.items():
                r = group.run(strategy, ckpt, verify=i == 0, cold=True)
                if not r.ok:
                    raise SystemExit(f"{name}: {r.error}")
                if r.correct is False:
                    raise SystemExit(f"{name}: differs from transformers: {r.mismatched[:5]}")
                out[name].append(r.seconds + r.touch_seconds)
                print(
                    f"{world} ranks {name:9s} #{i + 1}: {r.seconds + r.touch_seconds:.2f} s, "
                    f"resident before {r.resident_before:.1%}, cpu {r.cpu_seconds}, "
                    f"stream {r.phases.get('stream', 0.0):.2f} s",
                    flush=True,
                )
    finally:
        for group in groups.values():
            group.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--strategy", default="streamload")
    args = p.parse_args()
    name = os.path.basename(os.path.normpath(args.checkpoint))
    rows = []
    for world in args.ranks:
        res = run(args.checkpoint, world, args.repeat, args.strategy)
        med = {k: statistics.median(v) for k, v in res.items()}
        for k, v in res.items():
            rows.append(
                f"| {name} | {world} | {args.strategy} | {k} | {med[k]:.2f} ({min(v):.2f}-{max(v):.2f}) |"
            )
        rows.append(
            f"| {name} | {world} | {args.strategy} | buffered / o_direct | "
            f"{med['buffered'] / med['o_direct']:.2f}x |"
        )
    print("| checkpoint | ranks | strategy | reads | load + touch s, median (min-max) |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
