"""What the arrival check costs (streamload/transport/arrival.py): the meeting every entry point
holds in torch.distributed's store before its first collective, and the store watch on waits
(CPU collectives waited for in 1 s slices, the store asked between them).

N gloo ranks over a TCPStore (env://, as torchrun starts them): the meeting alone, 30 times;
then ``load_checkpoint`` (src, 4 MiB buckets: many waits per load) with the watch, with plain
``work.wait()`` swapped in, and with the watch again, taking turns. Medians with their range.

    python benchmarks/bench_arrival.py --ranks 2 3 [--gb 0.3] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, ckpt: str, repeat: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import streamload
    from streamload.transport import arrival, collectives, protocol

    mesh = init_device_mesh("cpu", (world,))
    meet = []
    for _ in range(30):
        dist.barrier()
        t = time.perf_counter()
        with arrival.meeting("bench", dist.group.WORLD, 60):
            pass
        meet.append(time.perf_counter() - t)
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, progress=False)

    def loads(n: int) -> list[float]:
        ts = []
        for _ in range(n):
            dist.barrier()
            t = time.perf_counter()
            streamload.load_checkpoint(
                model, ckpt, device_mesh=mesh, progress=False, readers="src", bucket_bytes=4 << 20
            )
            dist.barrier()
            ts.append(time.perf_counter() - t)
        return ts

    def plain(work: Any, device: Any = None) -> None:
        if work is not None:
            work.wait()

    watched = loads(repeat)
    collectives.wait_work = protocol.wait_work = plain  # type: ignore[assignment]
    unwatched = loads(repeat)
    collectives.wait_work = protocol.wait_work = arrival.wait_work  # type: ignore[assignment]
    watched += loads(repeat)
    if rank == 0:
        out.put((meet, watched, unwatched))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _shown(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms [{min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f}] (n={len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8, help="qwen2 layers of hidden 1024 (8: about 0.3 GB)")
    args = ap.parse_args()
    from streamload.tools.synthetic import make_checkpoint

    with tempfile.TemporaryDirectory() as d:
        ckpt = str(
            make_checkpoint(
                os.path.join(d, "ckpt"), "qwen2", layers=args.layers, vocab=32000, hidden_size=1024,
                intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, max_shard_size="1GB",
            )
        )  # fmt: skip
        ctx = mp.get_context("spawn")
        for world in args.ranks:
            q = ctx.Queue()
            port = _free_port()
            procs = [ctx.Process(target=_worker, args=(r, world, port, ckpt, args.repeat, q)) for r in range(world)]
            for p in procs:
                p.start()
            meet, watched, unwatched = q.get()
            for p in procs:
                p.join()
            ratio = statistics.median(watched) / statistics.median(unwatched)
            print(f"{world} ranks: meeting {_shown(meet)}")
            print(f"{world} ranks: load, store watch {_shown(watched)}; plain wait {_shown(unwatched)}; {ratio:.3f}x")


if __name__ == "__main__":
    main()
