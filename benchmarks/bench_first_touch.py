"""What a copy into fresh memory costs on this machine, against a copy into
memory already touched: the reason mapped shards (views of the page cache)
load faster than any copy on the CPU.

    python benchmarks/bench_first_touch.py [CKPT] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import streamload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", nargs="?", default="/tmp/streamload_bench_ckpts/qwen2_1.5gb")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not os.path.exists(args.checkpoint):
        from streamload.tools.synthetic import make_checkpoint, sized_config

        make_checkpoint(args.checkpoint, "qwen2", config=sized_config("qwen2", 1.5, tie=True))
    ckpt = streamload.Checkpoint(args.checkpoint, threads=args.threads)
    infos = [ckpt.info(n) for n in ckpt.keys()]
    total = sum(i.nbytes for i in infos)
    ckpt.read_into({i.name: torch.empty(i.shape, dtype=i.torch_dtype) for i in infos})  # warm the page cache
    outs = {i.name: torch.empty(i.shape, dtype=i.torch_dtype) for i in infos}
    t0 = time.perf_counter()
    ckpt.read_into(outs)
    fresh = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt.read_into(outs)
    touched = time.perf_counter() - t0
    print(
        f"{len(infos)} tensors, {total / 2**30:.2f} GiB, {args.threads} thread(s): "
        f"into fresh tensors {fresh:.3f} s ({total / fresh / 1e9:.2f} GB/s), "
        f"into the same tensors again {touched:.3f} s ({total / touched / 1e9:.2f} GB/s), "
        f"ratio {fresh / touched:.1f}x"
    )


if __name__ == "__main__":
    main()
