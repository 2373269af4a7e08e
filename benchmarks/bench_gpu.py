"""Page cache -> GPU: streamload (NCCL, world size 1, pinned staging ring)
vs safetensors.torch.load_file(device="cuda") vs the pinned host-to-device
bandwidth of this machine, in one run.

    python benchmarks/bench_gpu.py --gb 2.0
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def pinned_h2d_gbps(nbytes: int = 1 << 30, repeat: int = 5) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    import streamload
    from streamload.tools.synthetic import make_checkpoint, sized_config

    root = Path(tempfile.gettempdir()) / f"streamload_gpu_{args.gb:g}gb"
    if not (root / "config.json").exists():
        make_checkpoint(root, "qwen2", config=sized_config("qwen2", args.gb, tie=True), max_shard_size="2GB")
    files = sorted(root.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache
        with open(f, "rb") as h:
            while h.read(1 << 26):
                pass
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))

    def run_safetensors() -> None:
        for f in files:
            load_file(str(f), device="cuda")
        torch.cuda.synchronize()

    def run_streamload() -> None:
        model = streamload.from_pretrained(str(root), device_mesh=mesh, progress=False)
        torch.cuda.synchronize()
        del model

    results = {}
    for name, fn in [("streamload", run_streamload), ("safetensors_load_file_cuda", run_safetensors)]:
        fn()  # warm-up (imports, allocator)
        best = float("inf")
        for _ in range(args.repeat):
            torch.cuda.empty_cache()
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        results[name] = total / best / 1e9
    results["pinned_h2d"] = pinned_h2d_gbps()
    print(f"checkpoint {total / 2**30:.2f} GiB, one GPU ({torch.cuda.get_device_name(0)})")
    for k, v in results.items():
        print(f"{k:28s} {v:7.2f} GB/s  ({v / results['pinned_h2d']:.2f}x pinned H2D)")
    print(f"streamload vs safetensors: {results['streamload'] / results['safetensors_load_file_cuda']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"bytes": total, "gbps": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
