"""Loading an FP8 block-scaled checkpoint (>= 1 GB) into bf16 FSDP2 shards at
4 ranks, three ways side by side in one run, each repeated:

- streamload: dequantizes on the fly, each shard straight from the fp8
  blocks and scale rows it needs (no full dequantized tensor anywhere);
- rank0_broadcast: transformers' dequantizing from_pretrained on rank 0,
  then set_model_state_dict(broadcast_from_rank0=True);
- offline: ``streamload ingest --dtype bfloat16`` (dequantize to a bf16
  checkpoint on disk), then a streamload load of that; its time is both.

    python benchmarks/bench_quant.py --gb 1.0 --ranks 4 --repeat 3 --out bench_out/quant

Overhead = peak anonymous memory of the ranks over their baseline minus the
loaded anonymous shards (see bench_memory.py); for the offline way the ingest
process's own peak counts too (the larger of the two phases).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from streamload.tools.bench.runner import MemorySampler, run_strategy
from streamload.tools.quantized import make_fp8_checkpoint

MiB = 1 << 20


def ensure_checkpoint(root: Path, gb: float) -> str:
    """A Llama-shaped fp8 checkpoint of about ``gb`` GB (dims divide 128)."""
    hidden, inter, vocab = 2048, 5632, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter  # fp8 bytes per layer
    layers = max(1, round((gb * 1e9 - 2 * vocab * hidden * 2) / per_layer))
    path = root / f"llama_fp8_{gb:g}gb"
    if not (path / "config.json").exists():
        make_fp8_checkpoint(
            path, "llama", hidden_size=hidden, intermediate_size=inter, num_attention_heads=16,
            num_key_value_heads=16, layers=layers, vocab=vocab, max_shard_size="500MB",
        )  # fmt: skip
    return str(path)


def _ingest(src: str, dst: str, ready: Any, go: Any) -> None:
    import torch

    from streamload.tools.ingest import ingest

    ready.set()  # imports done: the parent takes its baseline now
    go.wait()
    ingest(src, dst, dtype=torch.bfloat16)


def run_offline(ckpt: str, ws: int, bucket: int, scratch: Path) -> dict[str, Any]:
    """Ingest (in its own process, memory sampled) then a streamload load of the result."""
    dst = scratch / "dequantized_bf16"
    shutil.rmtree(dst, ignore_errors=True)
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_ingest, args=(ckpt, str(dst), ready, go))
    proc.start()
    ready.wait()
    time.sleep(0.3)
    assert proc.pid is not None
    sampler = MemorySampler([proc.pid])
    t0 = time.perf_counter()
    go.set()
    proc.join()
    ingest_s = time.perf_counter() - t0
    sampler.stop()
    if proc.exitcode != 0:
        return {"ok": False, "error": f"ingest exited {proc.exitcode}"}
    load = run_strategy("streamload", str(dst), ws, bucket_bytes=bucket, verify=False)
    out = load.to_dict()
    out["ingest_seconds"] = ingest_s
    out["ingest_overhead_bytes"] = sampler.peak - sampler.baseline
    out["seconds"] = ingest_s + load.seconds
    out["overhead_bytes"] = max(load.overhead_bytes, sampler.peak - sampler.baseline)
    shutil.rmtree(dst, ignore_errors=True)
    return out


def _summary(rows: list[dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in rows if r.get("ok")]
    if not vals:
        return "n/a"
    scale = MiB if "bytes" in key else 1
    unit = " MiB" if "bytes" in key else " s"
    med = statistics.median(vals) / scale
    return f"{med:.1f}{unit} [{min(vals) / scale:.1f}-{max(vals) / scale:.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--ckpt-dir", default="/tmp/streamload_bench_ckpts")
    ap.add_argument("--out", default="bench_out/quant")
    args = ap.parse_args()
    root = Path(args.ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    ckpt = ensure_checkpoint(root, args.gb)
    size = sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors"))
    print(f"checkpoint {ckpt}: {size / 1e9:.2f} GB on disk", flush=True)
    bucket = args.bucket_mib * MiB
    rows: dict[str, list[dict[str, Any]]] = {"streamload": [], "rank0_broadcast": [], "offline": []}
    for rep in range(args.repeat):
        for way in rows:  # interleaved, so drift on this shared machine hits every way alike
            if way == "offline":
                r = run_offline(ckpt, args.ranks, bucket, root)
            else:
                r = run_strategy(way, ckpt, args.ranks, bucket_bytes=bucket, verify=False).to_dict()
                r.pop("timeline", None)
            rows[way].append(r)
            print(
                f"rep {rep} {way}: {r.get('seconds', 0):.2f}s overhead {r.get('overhead_bytes', 0) / MiB:.0f} MiB "
                f"{'ok' if r.get('ok') else 'FAILED ' + str(r.get('error'))}",
                flush=True,
            )
    lines = [
        f"fp8 checkpoint {size / 1e9:.2f} GB -> bf16, {args.ranks} ranks (gloo, CPU), "
        f"median [min-max] of {args.repeat}",
        "",
        "| way | seconds | overhead (peak anon - shards) |",
        "|---|---|---|",
    ]
    for way, rs in rows.items():
        lines.append(f"| {way} | {_summary(rs, 'seconds')} | {_summary(rs, 'overhead_bytes')} |")
    table = "\n".join(lines)
    print(table)
    Path(args.out, "bench_quant.md").write_text(table + "\n")
    Path(args.out, "bench_quant.json").write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
