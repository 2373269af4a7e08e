"""Cold loads with and without read-ahead across buckets, side by side in one run.

"before" is the cold path as it was before read-ahead: two read buffers of 32 MiB,
one chunk read at a time, no bucket announced ahead (the same code, with
``Packer._announce`` answering False and the old ``ColdEngine`` sizes); "after" is
the default. Each run: rank 0 evicts the checkpoint (checked with mincore), every
rank loads it with ``streamload.from_pretrained(read_mode="cold")``; the disk's
sequential bandwidth is measured before each run. Prints one line per variant and
reader: median load seconds (min-max), the time to read the files once, their
ratio, and rank 0's stream phases (``LoadReport.phases``) of the median run.

    python benchmarks/bench_cold_readahead.py CKPT --ranks 2 --repeat 3 --readers src owners
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _variant(name: str) -> None:
    """Makes this process load as ``name`` ("before" or "after") does."""
    from streamload.io import cold
    from streamload.transport.pack import Packer

    if name == "before":
        made = cold.ColdEngine

        class Before(made):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.update(chunk_bytes=32 << 20, buffers=2, lanes=1)
                super().__init__(*args, **kwargs)

        cold.ColdEngine = Before  # type: ignore[misc]
        Packer._announce = lambda self, batch, bucket: False  # type: ignore[method-assign]


def _worker(rank: int, world: int, init: str, ckpt: str, plan: list[tuple[str, str]], out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    import streamload
    from streamload.tools.bench.cold import disk_bandwidth, make_cold

    AutoModelForCausalLM._model_mapping[
        type(AutoConfig.from_pretrained(ckpt))
    ]  # import cost is not load cost
    mesh = init_device_mesh("cpu", (world,))
    variant_now = ""
    for variant, readers in plan:
        if variant != variant_now:
            dist.barrier()
            _variant(variant)  # "after" always comes first in a fresh process: see main
            variant_now = variant
        bw = disk_bandwidth(ckpt) if rank == 0 else None
        resident = make_cold(ckpt) if rank == 0 else 0.0
        dist.barrier()
        t0 = time.perf_counter()
        path = ckpt if readers != "src" or rank == 0 else "/nonexistent"
        model = streamload.from_pretrained(
            path, device_mesh=mesh, progress=False, readers=readers, read_mode="cold"
        )
        dist.barrier()
        seconds = time.perf_counter() - t0
        if rank == 0:
            assert bw is not None
            out.put(
                {
                    "variant": variant,
                    "readers": readers,
                    "seconds": seconds,
                    "disk_gbps": bw.gbps,
                    "file_bytes": bw.bytes,
                    "resident_before": resident,
                    "phases": dict(model.streamload_report.phases),
                }
            )
        del model
    dist.barrier()
    dist.destroy_process_group()


def _run(ckpt: str, world: int, plan: list[tuple[str, str]]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"/tmp/streamload_cold_ahead_{os.getpid()}_{time.time_ns()}"
    mp.start_processes(_worker, args=(world, init, ckpt, plan, out), nprocs=world, start_method="spawn")
    return [out.get() for _ in plan]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--readers", nargs="+", default=["src", "owners"])
    args = p.parse_args(argv)
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        # Variants take turns (a drifting disk or host hits both); "before" patches the
        # process, so each variant runs in its own process group.
        for variant in ("after", "before"):
            runs += _run(args.checkpoint, args.ranks, [(variant, r) for r in args.readers])
    print(f"{args.checkpoint}, {args.ranks} ranks, medians of {args.repeat} (min-max); busy shared machine")
    for readers in args.readers:
        for variant in ("before", "after"):
            rs = sorted(
                (r for r in runs if r["variant"] == variant and r["readers"] == readers),
                key=lambda r: r["seconds"],
            )
            mid = rs[(len(rs) - 1) // 2]
            once = statistics.median(r["file_bytes"] / (r["disk_gbps"] * 1e9) for r in rs)
            phases = ", ".join(
                f"{k} {v:.2f}" for k, v in mid["phases"].items() if k.startswith("stream") and v >= 0.005
            )
            print(
                f"| {readers} | {variant} | {mid['seconds']:.2f} ({rs[0]['seconds']:.2f}-{rs[-1]['seconds']:.2f}) "
                f"| {once:.2f} ({statistics.median(r['disk_gbps'] for r in rs):.2f} GB/s) "
                f"| {mid['seconds'] / once:.2f}x | {max(r['resident_before'] for r in rs):.1%} | {phases} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
