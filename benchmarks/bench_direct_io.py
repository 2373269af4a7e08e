"""Cold loads read two ways, interleaved: buffered reads whose plain copies land in their
destinations (the default), and O_DIRECT.

Each variant is a ``load_checkpoint`` keyword (``VARIANTS``), passed to the strategy as the
bench passes ``streamload bench --options``:

- ``buffered``: ``direct_io=False`` (what a load without ``drop_cache`` does by default);
  plain copies (same dtype, contiguous at both ends) are read straight into the shard or
  staging slot they fill; every reader asks for its windows with WILLNEED on a descriptor
  advised RANDOM.
- ``o_direct``: ``direct_io=True``.

By default one warm rank group (``BenchGroup``: processes started once, the model's modules
imported before the clock starts) serves every load; ``--fresh`` starts a new group for every
load instead, as ``streamload bench`` does (first-call costs included).
The variants take turns within each repeat (in reverse order every other repeat, since a load
can leave the host's cache in a state the next one inherits), so a slow patch of the shared disk
hits each.
Before every load the checkpoint is evicted and checked with mincore (``make_cold``).
Prints each load, then per variant the median load + first-touch seconds with min-max, the
median CPU seconds of rank 0 (the reader in ``src``) and of all ranks together, and each
variant's median over the first variant's. A buffered read costs a kernel copy per byte
that O_DIRECT does not: the CPU columns show what the wall time buys.

    python benchmarks/bench_direct_io.py CKPT --ranks 2 4 --repeat 6 [--fresh] \
        [--strategy streamload] [--variants buffered o_direct]

``--strategy`` is a ``streamload bench`` strategy: ``streamload`` (src: rank 0 reads and
scatters) or ``streamload_owners`` (every rank reads its own shards).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from streamload.tools.bench.runner import BenchGroup

# Each variant's load_checkpoint keywords.
VARIANTS: dict[str, dict[str, Any]] = {
    "buffered": {"direct_io": False},
    "o_direct": {"direct_io": True},
}


@dataclass
class Loads:
    """One variant's loads: wall seconds (load + first touch) and CPU seconds."""

    seconds: list[float] = field(default_factory=list)
    rank0_cpu: list[float] = field(default_factory=list)
    total_cpu: list[float] = field(default_factory=list)


def run(
    ckpt: str, world: int, repeat: int, strategy: str, variants: Sequence[str], fresh: bool = False
) -> dict[str, Loads]:
    """Interleaved cold loads, per variant; ``fresh``: new rank processes for every load."""
    warm = None if fresh else BenchGroup(world)
    out: dict[str, Loads] = {name: Loads() for name in variants}
    try:
        for i in range(repeat):
            # Every other repeat in reverse: each variant follows each other one as often.
            for name in variants if i % 2 == 0 else list(reversed(variants)):
                group = warm if warm is not None else BenchGroup(world)
                try:
                    r = group.run(strategy, ckpt, verify=i == 0, cold=True, **VARIANTS[name])
                finally:
                    if warm is None:
                        group.close()
                if not r.ok:
                    raise SystemExit(f"{name}: {r.error}")
                if r.correct is False:
                    raise SystemExit(f"{name}: differs from transformers: {r.mismatched[:5]}")
                loads = out[name]
                loads.seconds.append(r.seconds + r.touch_seconds)
                loads.rank0_cpu.append(r.cpu_seconds[0])
                loads.total_cpu.append(sum(r.cpu_seconds))
                print(
                    f"{world} ranks {name:12s} #{i + 1}: {r.seconds + r.touch_seconds:.2f} s, "
                    f"resident before {r.resident_before:.1%}, cpu {r.cpu_seconds}, "
                    f"stream {r.phases.get('stream', 0.0):.2f} s",
                    flush=True,
                )
    finally:
        if warm is not None:
            warm.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--strategy", default="streamload")
    p.add_argument("--fresh", action="store_true", help="new rank processes for every load")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = p.parse_args()
    name = os.path.basename(os.path.normpath(args.checkpoint))
    groups = "fresh" if args.fresh else "warm"
    rows = []
    for world in args.ranks:
        res = run(args.checkpoint, world, args.repeat, args.strategy, args.variants, args.fresh)
        med = {k: statistics.median(v.seconds) for k, v in res.items()}
        for k, v in res.items():
            rows.append(
                f"| {name} | {world} | {args.strategy} | {groups} | {k} | "
                f"{med[k]:.2f} ({min(v.seconds):.2f}-{max(v.seconds):.2f}) | "
                f"{statistics.median(v.rank0_cpu):.2f} | {statistics.median(v.total_cpu):.2f} |"
            )
        first = args.variants[0]
        for k in args.variants[1:]:
            rows.append(
                f"| {name} | {world} | {args.strategy} | {groups} | {k} / {first} | "
                f"{med[k] / med[first]:.2f}x | | |"
            )
    print(
        "| checkpoint | ranks | strategy | groups | reads | load + touch s, median (min-max) "
        "| rank 0 CPU s | all ranks CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
