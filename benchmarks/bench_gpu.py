"""Page cache -> GPU, one NCCL rank, in one run (benchmarks/gpu_check.sh runs it):

1. readers="owners" loads a >= 2 GB checkpoint 3 times; every byte of every
   parameter is compared with safetensors' own read of the same tensor;
2. GB/s of streamload (owners and src) against ``safetensors.torch.load_file(device="cuda")``
   and the pinned host-to-device bandwidth, all measured here;
3. 5 reloads: ``torch.cuda.memory_allocated``, torch's pinned host cache, the bytes
   streamload still holds page-locked and the number of process groups after each
   (none may grow; the exit status says so);
4. bucket sizes 32-512 MiB, owners and src (the GPU default, 256 MiB, was never measured).

    python benchmarks/bench_gpu.py --gb 2.0 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20


def pinned_h2d_gbps(nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """Best-of-``repeat`` pinned host -> device copy rate (the ceiling a loader can reach)."""
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
    del host, dev
    return nbytes / best / 1e9


def pinned_cache_bytes() -> int:
    """Bytes torch's caching host allocator holds (pinned blocks, in use or cached)."""
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("allocated_bytes.current", stats.get("allocated_bytes.all.current", 0)))


def process_groups() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)  # private: bench only, fails loudly if renamed


def compare_with_safetensors(model: Any, files: list[Path]) -> int:
    """Every parameter's bytes against safetensors' read of the same key; returns bytes compared."""
    from safetensors import safe_open

    from streamload.io.copy_ops import bit_view

    params = dict(model.named_parameters())
    compared = 0
    for f in files:
        with safe_open(str(f), "pt", device="cuda") as h:
            for key in h.keys():
                if key not in params:
                    continue  # a tied alias: the canonical parameter is compared
                want = h.get_tensor(key)
                got = params.pop(key).full_tensor()
                if got.dtype != want.dtype or not torch.equal(bit_view(got), bit_view(want)):
                    raise SystemExit(f"MISMATCH: {key} differs from safetensors")
                compared += want.numel() * want.element_size()
    if params:
        raise SystemExit(f"MISMATCH: parameters not in the files: {sorted(params)[:5]}")
    return compared


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reloads", type=int, default=5)
    ap.add_argument("--buckets", type=int, nargs="+", default=[32, 64, 128, 256, 512], help="MiB")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    import streamload
    from streamload.tools.synthetic import make_checkpoint, sized_config

    t_start = time.perf_counter()
    root = Path(tempfile.gettempdir()) / f"streamload_gpu_{args.gb:g}gb"
    if not (root / "config.json").exists():
        make_checkpoint(root, "qwen2", config=sized_config("qwen2", args.gb, tie=True), max_shard_size="2GB")
    files = sorted(root.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache: every figure below is page cache -> GPU
        with open(f, "rb") as h:
            while h.read(1 << 26):
                pass
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    print(
        f"checkpoint {total / 2**30:.2f} GiB in {len(files)} files, one GPU ({torch.cuda.get_device_name(0)})"
    )
    out: dict[str, Any] = {"bytes": total, "device": torch.cuda.get_device_name(0)}

    def load(readers: str, bucket_mib: int | None = None) -> Any:
        bucket = bucket_mib * MiB if bucket_mib else None
        return streamload.from_pretrained(
            str(root), device_mesh=mesh, progress=False, readers=readers, bucket_bytes=bucket
        )

    # 1. owners mode, 3 loads, every byte against safetensors.
    checked = []
    for i in range(3):
        model = load("owners")
        assert model.streamload_report.reader.startswith("owners"), model.streamload_report.reader
        checked.append(compare_with_safetensors(model, files))
        print(f"owners load {i + 1}: {checked[-1] / 1e9:.2f} GB compared with safetensors, equal")
        del model
        gc.collect()
    out["owners_bytes_compared"] = checked

    # 2. GB/s, side by side.
    def best_of(fn: Any, repeat: int = args.repeat, warm: bool = True) -> float:
        if warm:
            fn()  # warm-up (imports, allocator, NCCL)
        best = float("inf")
        for _ in range(repeat):
            gc.collect()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return total / best / 1e9

    def run_load(readers: str, bucket_mib: int | None = None) -> Any:
        return lambda: load(readers, bucket_mib)

    def run_safetensors() -> None:
        for f in files:
            load_file(str(f), device="cuda")

    gbps = {
        "streamload_owners": best_of(run_load("owners")),
        "streamload_src": best_of(run_load("src")),
        "safetensors_load_file_cuda": best_of(run_safetensors),
        "pinned_h2d": pinned_h2d_gbps(),
    }
    for k, v in gbps.items():
        print(f"{k:28s} {v:7.2f} GB/s  ({v / gbps['pinned_h2d']:.2f}x pinned H2D)")
    print(f"owners vs safetensors: {gbps['streamload_owners'] / gbps['safetensors_load_file_cuda']:.2f}x")
    out["gbps"] = gbps

    # 3. Reloads: nothing may grow.
    from streamload.transport import staging

    rows = []
    model = None
    for i in range(args.reloads):
        del model
        gc.collect()
        model = load("owners")
        torch.cuda.synchronize()
        row = {
            "reload": i + 1,
            "memory_allocated": torch.cuda.memory_allocated(),
            "pinned_host_cache": pinned_cache_bytes(),
            "streamload_registered": staging.registered_bytes(),
            "process_groups": process_groups(),
        }
        rows.append(row)
        print("reload", " ".join(f"{k}={v}" for k, v in row.items()))
    del model
    gc.collect()
    grew = [k for k in rows[0] if k != "reload" and any(r[k] > rows[0][k] for r in rows[1:])]
    held = rows[-1]["streamload_registered"]
    out["reloads"] = rows
    print("reloads: nothing grew" if not grew else f"reloads: GREW: {grew}")

    # 4. Bucket sizes (everything is warm by now: best of 2).
    sweep = {}
    for readers in ("owners", "src"):
        for mib in args.buckets:
            sweep[f"{readers}_{mib}MiB"] = best_of(run_load(readers, mib), repeat=2, warm=False)
            print(f"{readers:6s} bucket {mib:4d} MiB: {sweep[f'{readers}_{mib}MiB']:7.2f} GB/s")
    out["bucket_sweep_gbps"] = sweep
    out["seconds"] = time.perf_counter() - t_start
    print(f"bench took {out['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()
    if grew or held:
        sys.exit(f"memory or process groups grew across reloads: {grew}, registered {held}")


if __name__ == "__main__":
    main()
