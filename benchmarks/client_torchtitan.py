"""torchtitan 0.3.0's own HF load vs streamload swapped in, side by side in one run.

Both start from torchtitan's flow: the Qwen3 model built on meta and parallelised with
torchtitan's own ``parallelize_qwen3`` (FSDP over every rank, gloo on CPUs).
- torchtitan: ``to_empty`` + ``init_weights``, then ``CheckpointManager.dcp_load`` with
  ``from_hf=True`` (``to_hf``, DCP's ``HuggingFaceStorageReader``, ``from_hf``,
  ``load_state_dict``, whose fused-QKV hook all-gathers ``wq/wk/wv``), called as is.
- streamload: ``streamload.load_checkpoint(model, hf_dir, mapping=adapter)``.
Per rank: load seconds (slowest rank) and the peak of the rank's own anonymous memory
over its baseline (RssAnon, sampled every 10 ms by streamload.tools.bench's sampler;
the largest rank). Medians of ``--repeats`` runs with their min-max spread; the two
alternate order each repeat. Bit-exact: on the first repeat every parameter and buffer's
full tensor of the two models is compared as bytes (outside the timed part).

    python benchmarks/client_torchtitan.py --ranks 2 4 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MiB = 1 << 20
# Models that load in well under a minute per repeat on 2 shared cores.
MODELS: dict[str, dict[str, Any]] = {
    "dense": dict(
        kind="dense", dim=1024, head_dim=64, n_heads=16, n_kv_heads=4, vocab=32000, layers=8, hidden=3072
    ),
    "moe": dict(
        kind="moe",
        dim=768,
        head_dim=64,
        n_heads=12,
        n_kv_heads=4,
        vocab=32000,
        layers=4,
        experts=32,
        moe_hidden=384,
        top_k=4,
    ),
}


def _trim() -> None:
    from streamload.tools.bench.runner import _trim as trim

    gc.collect()
    trim()


def _one(strategy: str, cfg: Any, path: str, world: int) -> tuple[Any, float, int]:
    import titan_models as tm
    import torch
    import torch.distributed as dist

    import streamload
    from streamload.tools.bench.runner import MemorySampler

    model = tm.build_meta(cfg)
    tm.parallelize(model, world)
    _trim()
    dist.barrier()
    sampler = MemorySampler([os.getpid()])
    t0 = time.perf_counter()
    if strategy == "torchtitan":
        model.to_empty(device="cpu")
        model.init_weights(buffer_device=torch.device("cpu"))
        tm.titan_own_load(model, cfg, path)
    else:
        streamload.load_checkpoint(model, path, mapping=tm.adapter_for(cfg), progress=False)
    seconds = time.perf_counter() - t0
    sampler.stop()
    return model, seconds, sampler.peak - sampler.baseline


def _worker(
    rank: int, world: int, init: str, jobs: list[tuple[str, str, dict[str, Any]]], repeats: int, q: Any
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import titan_models as tm
    import torch
    import torch.distributed as dist
    from cases_titan import compare

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    for name, path, dims in jobs:
        dims = {k: v for k, v in dims.items() if k != "kind"}
        cfg = tm.titan_config(MODELS[name]["kind"], **dims)
        for rep in range(repeats):
            order = ["torchtitan", "streamload"] if rep % 2 == 0 else ["streamload", "torchtitan"]
            models = {}
            for strategy in order:
                model, seconds, peak = _one(strategy, cfg, path, world)
                q.put((name, world, strategy, rep, rank, seconds, peak))
                if rep == 0:
                    models[strategy] = model
                del model
                _trim()
            if rep == 0:
                bad = compare(models["streamload"], models["torchtitan"])
                q.put((name, world, "exact", rep, rank, float(not bad), 0))
            models.clear()
            _trim()
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, jobs: list[tuple[str, str, dict[str, Any]]], repeats: int) -> list[tuple]:
    ctx = mp.get_context("spawn")
    fd, init = tempfile.mkstemp(prefix="titan_bench_")
    os.close(fd)
    os.unlink(init)
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, init, jobs, repeats, q)) for r in range(world)]
    for p in procs:
        p.start()
    expected = world * len(jobs) * (2 * repeats + 1)
    out = [q.get(timeout=1800) for _ in range(expected)]
    for p in procs:
        p.join(timeout=60)
    return out


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def rows(results: list[tuple]) -> list[str]:
    by: dict[tuple, dict[int, list[tuple[float, int]]]] = {}
    exact: dict[tuple, bool] = {}
    for name, world, strategy, rep, _rank, seconds, peak in results:
        if strategy == "exact":
            exact[(name, world)] = exact.get((name, world), True) and seconds == 1.0
            continue
        by.setdefault((name, world, strategy), {}).setdefault(rep, []).append((seconds, peak))
    lines = []
    for name, world in sorted({(k[0], k[1]) for k in by}):
        cells = []
        for strategy in ("torchtitan", "streamload"):
            reps = by[(name, world, strategy)]
            secs = [max(s for s, _ in v) for v in reps.values()]  # the slowest rank decides
            peaks = [max(p for _, p in v) / MiB for v in reps.values()]  # the largest rank
            cells.append((secs, peaks))
        (ts, tp), (ss, sp) = cells
        lines.append(
            f"| torchtitan qwen3 {name} | {world} | {_med(ts)} | {_med(ss)} | {_med(tp)} | {_med(sp)} | "
            f"{'yes' if exact.get((name, world)) else 'NO'} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--ckpt-dir", default="/tmp/streamload_titan_bench")
    args = ap.parse_args()
    import titan_models as tm

    root = Path(args.ckpt_dir)
    jobs = []
    for name in args.models:
        dims = dict(MODELS[name])
        kind = dims.pop("kind")
        path = root / name
        if not (path / "config.json").exists():
            tm.write_checkpoint(path, kind, seed=7, shard="200MB", **dims)
        jobs.append((name, str(path), MODELS[name]))
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"{name}: {size / MiB:.0f} MiB bf16 checkpoint -> fp32 model", flush=True)
    results = []
    for world in args.ranks:
        results += run_world(world, jobs, args.repeats)
    print(
        "| model | ranks | torchtitan load s | streamload s | torchtitan peak anon/rank MiB | "
        "streamload peak anon/rank MiB | bit-exact |"
    )
    print("|---|---|---|---|---|---|---|")
    for line in rows(results):
        print(line, flush=True)


if __name__ == "__main__":
    main()
