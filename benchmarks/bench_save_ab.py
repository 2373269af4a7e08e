"""A/B of ``save_pretrained`` between two source trees, taking turns on one machine.

The disk's write-back moves a save's time more than most code changes, so two versions are timed
against each other in the same minutes rather than against an old table. Each call loads the
checkpoint once (gloo ranks, one FSDP mesh) and saves it REPS times; the ranks' barrier-to-barrier
time of every save is printed as one JSON line. Run it alternately for each tree:

    git archive <commit> streamload | tar -x -C /tmp/old   # and the same for the new tree
    cp build/*/_streamload*.so /tmp/old/streamload/          # the built extension, into each
    SL_TREE=/tmp/old python benchmarks/bench_save_ab.py CKPT 2 owners 3
    SL_TREE=/tmp/new python benchmarks/bench_save_ab.py CKPT 2 owners 3

``SL_TREE`` is put first on ``sys.path`` and the editable install's import hook is removed, in the
parent and in every spawned rank (they re-run this module's top level).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

TREE = os.environ["SL_TREE"]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
sys.path.insert(0, TREE)

import torch  # noqa: E402 - after the path is set
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _rank(rank: int, world: int, ckpt: str, port: int, out: str, writers: str, reps: int, q: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import streamload

    assert streamload.__file__.startswith(TREE), streamload.__file__
    model = streamload.from_pretrained(ckpt, device_mesh=init_device_mesh("cpu", (world,)), progress=False)
    times = []
    for i in range(reps):
        target = os.path.join(out, f"o{i}")
        dist.barrier()
        t0 = time.perf_counter()
        streamload.save_pretrained(model, target, writers=writers)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if rank == 0:
            shutil.rmtree(target)
    q.put((rank, times))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> None:
    ckpt, world, writers, reps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    out = tempfile.mkdtemp(prefix="bench_save_ab_")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (world, ckpt, 29651, out, writers, reps, q)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    res = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"tree": TREE, "world": world, "writers": writers, "times": res[0]}))


if __name__ == "__main__":
    main()
