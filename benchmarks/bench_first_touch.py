"""What a copy into fresh memory costs on this machine: the copy engine with its
destination pages faulted in one trap at a time as it writes them (populate off),
with each piece's pages faulted in by one madvise first (populate on, the default),
and into memory already touched. Medians of --repeat runs (min-max), the page cache
warm. The reason mapped shards (views of the page cache) load faster than any copy
on the CPU, and what populating buys.

    python benchmarks/bench_first_touch.py [CKPT] [--threads 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import streamload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", nargs="?", default="/tmp/streamload_bench_ckpts/qwen2_1.5gb")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not os.path.exists(args.checkpoint):
        from streamload.tools.synthetic import make_checkpoint, sized_config

        make_checkpoint(args.checkpoint, "qwen2", config=sized_config("qwen2", 1.5, tie=True))
    ckpt = streamload.Checkpoint(args.checkpoint, threads=args.threads)
    infos = [ckpt.info(n) for n in ckpt.keys()]
    total = sum(i.nbytes for i in infos)

    def fresh() -> dict[str, torch.Tensor]:
        """Every tensor a view of one new private anonymous mapping: pages never touched (the
        allocator would hand back freed, already-faulted memory for a second round)."""
        arena = torch.frombuffer(
            mmap.mmap(-1, total + 64 * len(infos), flags=mmap.MAP_PRIVATE), dtype=torch.uint8
        )
        outs, at = {}, 0
        for i in infos:
            at += -at % 64
            outs[i.name] = arena[at : at + i.nbytes].view(i.torch_dtype).view(i.shape)
            at += i.nbytes
        return outs

    def timed(outs: dict[str, torch.Tensor], populate: bool) -> float:
        ckpt.engine.populate = populate
        t0 = time.perf_counter()
        ckpt.read_into(outs)
        return time.perf_counter() - t0

    timed(fresh(), True)  # warm the page cache
    runs: dict[str, list[float]] = {"fresh, populate off": [], "fresh, populate on": [], "touched again": []}
    for _ in range(args.repeat):  # the three take turns
        runs["fresh, populate off"].append(timed(fresh(), False))
        runs["fresh, populate on"].append(timed(fresh(), True))
        outs = fresh()
        timed(outs, True)
        runs["touched again"].append(timed(outs, True))
    print(
        f"{len(infos)} tensors, {total / 2**30:.2f} GiB, {args.threads} thread(s), {args.repeat} runs each:"
    )
    for label, secs in runs.items():
        med = statistics.median(secs)
        print(f"  {label:20s} {med:.3f} s ({min(secs):.3f}-{max(secs):.3f}), {total / med / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
