"""Runs one strategy in a fresh process group and measures it side by side:
wall time, each rank's peak RSS, and the system-wide peak of anonymous
memory over the baseline (sampled from /proc/meminfo), then verifies every
parameter against transformers in a separate pass that the figures never see."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import resource
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

SAMPLE_SECONDS = 0.01


def anon_bytes() -> int:
    """System-wide anonymous memory (AnonPages), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonPages:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("AnonPages not in /proc/meminfo")


class MemorySampler:
    """Samples AnonPages on a thread; keeps the peak and a timeline."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.peak = baseline
        self.timeline: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            v = anon_bytes()
            self.peak = max(self.peak, v)
            self.timeline.append((time.perf_counter() - self._t0, v - self.baseline))
            time.sleep(SAMPLE_SECONDS)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class RunResult:
    strategy: str
    world: int
    checkpoint: str
    ok: bool
    error: str | None = None
    seconds: float = 0.0
    peak_anon_over_baseline: int = 0
    shard_bytes: int = 0
    overhead_bytes: int = 0
    peak_rss: list[int] = field(default_factory=list)
    bytes_moved: int = 0
    gbps: float = 0.0
    correct: bool | None = None
    mismatched: list[str] = field(default_factory=list)
    tie_held: bool | None = None
    timeline: list[tuple[float, int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tie_held(model: Any) -> bool | None:
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "tie_word_embeddings", False):
        return None
    head = getattr(model, "lm_head", None)
    emb = model.get_input_embeddings()
    return head is not None and head.weight is emb.weight


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _verify(model: Any, ckpt: str, dtype: torch.dtype, rank: int) -> list[str]:
    """Every parameter and buffer against transformers' from_pretrained (rank 0 decides)."""
    from .strategies import _quiet_from_pretrained

    ref = _quiet_from_pretrained(ckpt, dtype) if rank == 0 else None
    ref_state = dict(ref.named_parameters()) | dict(ref.named_buffers()) if ref is not None else {}
    bad = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if rank == 0:
            r = ref_state.get(name)
            if (
                r is None
                or r.shape != full.shape
                or r.dtype != full.dtype
                or not torch.equal(_bits(r), _bits(full))
            ):
                bad.append(name)
    return bad


def _worker(
    rank: int,
    world: int,
    init_file: str,
    strategy: str,
    ckpt: str,
    dtype_name: str,
    opts: dict[str, Any],
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .strategies import STRATEGIES

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    dtype = getattr(torch, dtype_name)
    # Import cost is not load cost: import the model's modeling module now.
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(ckpt))]

    ready.put(rank)
    go.wait()
    out: dict[str, Any] = {"rank": rank}
    try:
        t0 = time.perf_counter()
        model = STRATEGIES[strategy](ckpt, mesh, dtype, opts)
        dist.barrier()
        out["seconds"] = time.perf_counter() - t0
        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["tie_held"] = _tie_held(model)
        shard = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
            for p in model.parameters()
        )
        out["shard_bytes"] = shard
        out["bytes_moved"] = getattr(getattr(model, "streamload_report", None), "payload_bytes", 0)
        results.put(("timed", out))
        go_verify = opts.get("verify", True)
        if go_verify:
            bad = _verify(model, ckpt, dtype, rank)
            results.put(("verified", {"rank": rank, "mismatched": bad}))
    except BaseException as exc:  # noqa: BLE001 - a failing strategy is a result, not a crash
        results.put(
            (
                "error",
                {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()},
            )
        )
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_strategy(
    strategy: str,
    ckpt: str,
    world: int,
    *,
    dtype: str = "bfloat16",
    verify: bool = True,
    timeout: float = 900.0,
    **opts: Any,
) -> RunResult:
    """Loads ``ckpt`` with ``strategy`` on ``world`` fresh gloo ranks and measures it."""
    ctx = mp.get_context("spawn")
    fd, init_file = tempfile.mkstemp(prefix="streamload_bench_pg_")
    os.close(fd)
    os.unlink(init_file)
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, init_file, strategy, ckpt, dtype, {**opts, "verify": verify}, ready, go, results),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    res = RunResult(strategy, world, ckpt, ok=False)
    sampler: MemorySampler | None = None
    try:
        for _ in range(world):
            ready.get(timeout=300)
        time.sleep(0.5)  # let import-time allocations settle before the baseline
        sampler = MemorySampler(anon_bytes())
        go.set()
        timed: list[dict[str, Any]] = []
        deadline = time.time() + timeout
        while len(timed) < world:
            kind, payload = results.get(timeout=max(1.0, deadline - time.time()))
            if kind == "error":
                res.error = payload["error"]
                return res
            if kind == "timed":
                timed.append(payload)
        sampler.stop()
        res.ok = True
        res.seconds = max(t["seconds"] for t in timed)
        res.peak_rss = [t["peak_rss"] for t in sorted(timed, key=lambda t: t["rank"])]
        res.shard_bytes = sum(t["shard_bytes"] for t in timed)
        res.peak_anon_over_baseline = sampler.peak - sampler.baseline
        res.overhead_bytes = res.peak_anon_over_baseline - res.shard_bytes
        res.bytes_moved = max(t["bytes_moved"] for t in timed) or res.shard_bytes
        res.gbps = res.bytes_moved / res.seconds / 1e9 if res.seconds else 0.0
        ties = {t["tie_held"] for t in timed}
        res.tie_held = None if ties == {None} else all(t is True for t in ties)
        res.timeline = sampler.timeline
        if verify:
            verified = 0
            while verified < world:
                kind, payload = results.get(timeout=max(1.0, deadline - time.time()))
                if kind == "error":
                    res.correct, res.error = False, payload["error"]
                    break
                if kind == "verified":
                    verified += 1
                    if payload["rank"] == 0:
                        res.mismatched = payload["mismatched"]
            else:
                res.correct = not res.mismatched
        return res
    except queue.Empty:
        res.ok = False
        res.error = f"timed out after {timeout}s"
        return res
    finally:
        if sampler is not None:
            sampler.stop()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
