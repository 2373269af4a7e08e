"""Runs one strategy in a fresh process group and measures it side by side:
wall time, each rank's peak RSS, and the peak of the ranks' anonymous memory
over the baseline (their RssAnon together, sampled every 10 ms; the
system-wide AnonPages is kept beside it), then verifies every
parameter against transformers in a separate pass that the figures never see.

Some loaders leave shards as views of the files (safetensors' mmap, read when
first touched) rather than private memory. So that the figures compare like
with like, each rank also reports how many of its shard bytes are file-backed
(from /proc/self/maps) and how long a first touch of every shard page takes
after the load; the overhead is peak anonymous memory minus the shards that
are anonymous."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import resource
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...io.copy_ops import bit_view

SAMPLE_SECONDS = 0.01


def anon_bytes(pids: list[int] | None = None) -> int:
    """Anonymous memory in bytes: the RssAnon of ``pids`` together, or the
    whole system's AnonPages without them."""
    if pids is None:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("AnonPages:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("AnonPages not in /proc/meminfo")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass  # a rank that has exited holds nothing
    return total


class MemorySampler:
    """Samples the ranks' anonymous memory (their RssAnon together) on a
    thread, and the system's AnonPages beside it; keeps the peaks and a
    timeline. Counting the ranks alone keeps other tenants of a shared
    machine out of the figures."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        # Each rank's own baseline and peak too: a client's rank 0 and its receivers differ.
        self.rank_baseline = [anon_bytes([p]) for p in pids]
        self.rank_peak = list(self.rank_baseline)
        self.baseline = sum(self.rank_baseline)
        self.peak = self.baseline
        self.system_baseline = anon_bytes()
        self.system_peak = self.system_baseline
        self.timeline: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            each = [anon_bytes([p]) for p in self.pids]
            self.rank_peak = [max(a, b) for a, b in zip(self.rank_peak, each, strict=True)]
            v = sum(each)
            self.peak = max(self.peak, v)
            self.system_peak = max(self.system_peak, anon_bytes())
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
    file_backed_shard_bytes: int = 0  # shard bytes that are views of the checkpoint files
    overhead_bytes: int = 0  # peak anon over baseline minus the anonymous shard bytes
    system_anon_over_baseline: int = 0  # the same peak, system-wide (AnonPages; noisier)
    touch_seconds: float = 0.0  # after the load: reading one byte of every shard page
    # From the start of the load through the touch and one in-place update of
    # every parameter (what a first optimizer step writes): the cost to training.
    first_step_seconds: float = 0.0
    cpu_seconds: list[float] = field(default_factory=list)  # per rank, the load's CPU time (every thread)
    disk_bytes_read: list[int] = field(default_factory=list)  # per rank, by cold reads (LoadReport)
    peak_rss: list[int] = field(default_factory=list)
    peak_anon_per_rank: list[int] = field(default_factory=list)  # each rank's, over its baseline
    bytes_moved: int = 0
    gbps: float = 0.0
    correct: bool | None = None
    mismatched: list[str] = field(default_factory=list)
    tie_held: bool | None = None
    timeline: list[tuple[float, int]] = field(default_factory=list)
    cold: bool = False  # the checkpoint was evicted from the page cache before the load
    resident_before: float = 0.0  # fraction of its weight pages still cached then (mincore)
    phases: dict[str, float] = field(default_factory=dict)  # rank 0's LoadReport.phases (streamload only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tie_held(model: Any) -> bool | None:
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "tie_word_embeddings", False):
        return None
    head = getattr(model, "lm_head", None)
    emb = model.get_input_embeddings()
    return head is not None and head.weight is emb.weight


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed mappings."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return sorted(out)


def _local_shards(model: Any) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        if id(p) not in seen and t.numel():
            seen.add(id(p))
            out.append(t.detach())
    return out


def _file_backed_bytes(shards: list[torch.Tensor]) -> int:
    import bisect

    maps = _file_mappings()
    starts = [lo for lo, _ in maps]
    total = 0
    for t in shards:
        ptr = t.data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and maps[i][0] <= ptr < maps[i][1]:
            total += t.numel() * t.element_size()
    return total


def _touch(shards: list[torch.Tensor]) -> None:
    """Reads one byte of every 4 KiB page of every shard."""
    for t in shards:
        flat = (
            t.reshape(-1).view(torch.uint8)
            if t.is_contiguous()
            else t.contiguous().view(-1).view(torch.uint8)
        )
        int(flat[::4096].sum())


@torch.no_grad()
def _first_write(shards: list[torch.Tensor], delta: int = 1) -> None:
    """One in-place update of every byte of every shard, as an optimizer step
    writes every parameter (mapped shards pay their copy-on-write faults here,
    copies nothing more). Bytes wrap modulo 256, so ``delta=-1`` undoes it
    exactly and the correctness pass still sees the loaded values."""
    for t in shards:
        t.view(-1).view(torch.uint8).add_(delta)


def _verify(model: Any, ckpt: str, dtype: torch.dtype, rank: int) -> list[str]:
    """Every parameter and buffer against transformers' from_pretrained (rank 0 decides)."""
    from .strategies import quiet_from_pretrained

    ref = quiet_from_pretrained(ckpt, dtype) if rank == 0 else None
    ref_state = dict(ref.named_parameters()) | dict(ref.named_buffers()) if ref is not None else {}
    return mismatched(list(model.named_parameters()) + list(model.named_buffers()), ref_state, rank)


def mismatched(tensors: list[tuple[str, torch.Tensor]], ref: dict[str, torch.Tensor], rank: int) -> list[str]:
    """Collective over the tensors' meshes: the names whose full tensor differs from ``ref`` in
    shape, dtype or any bit (decided on rank 0; other ranks only take part in the gathers)."""
    bad = []
    for name, t in tensors:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if rank == 0:
            r = ref.get(name)
            if (
                r is None
                or r.shape != full.shape
                or r.dtype != full.dtype
                or not torch.equal(bit_view(r), bit_view(full))
            ):
                bad.append(name)
        del full
    return bad


def _cpu_seconds() -> float:
    """CPU time of this process so far, every thread, user and system."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _worker(rank: int, world: int, init_file: str, commands: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .strategies import strategy_fn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        strategy, ckpt, dtype_name, opts = cmd
        dtype = getattr(torch, dtype_name)
        # Import cost is not load cost: import the model's modeling module now
        # (and a client strategy's module, which imports its framework).
        load = strategy_fn(strategy)
        from transformers import AutoConfig, AutoModelForCausalLM

        AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(ckpt))]
        warmup = getattr(load, "warmup", None)  # e.g. a client's own imports
        if warmup is not None:
            warmup()
        gc.collect()
        _trim()
        results.put(("ready", {"rank": rank}))
        commands.get()  # go
        model = None
        try:
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            model = load(ckpt, mesh, dtype, opts)
            dist.barrier()
            out: dict[str, Any] = {"rank": rank, "seconds": time.perf_counter() - t0}
            out["cpu_seconds"] = _cpu_seconds() - cpu0
            out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            out["tie_held"] = _tie_held(model)
            shards = _local_shards(model)
            out["shard_bytes"] = sum(t.numel() * t.element_size() for t in shards)
            out["file_backed_shard_bytes"] = _file_backed_bytes(shards)
            t1 = time.perf_counter()
            _touch(shards)
            dist.barrier()
            out["touch_seconds"] = time.perf_counter() - t1
            _first_write(shards)
            dist.barrier()
            out["first_step_seconds"] = time.perf_counter() - t0
            _first_write(shards, -1)
            out["bytes_moved"] = getattr(getattr(model, "streamload_report", None), "payload_bytes", 0)
            out["disk_bytes_read"] = getattr(getattr(model, "streamload_report", None), "disk_bytes_read", 0)
            out["phases"] = dict(getattr(getattr(model, "streamload_report", None), "phases", {}))
            results.put(("timed", out))
            if opts.get("verify", True):
                results.put(("verified", {"rank": rank, "mismatched": _verify(model, ckpt, dtype, rank)}))
        except BaseException as exc:  # noqa: BLE001 - a failing strategy is a result, not a crash
            results.put(
                (
                    "error",
                    {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()},
                )
            )
        del model
        gc.collect()
        _trim()
        results.put(("done", {"rank": rank}))
    # Tear down together: a rank that destroys its group while a peer is still
    # finishing the last collective can abort in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


def warm_page_cache(ckpt: str) -> int:
    """Reads every file of the checkpoint once, so that every strategy starts
    from the same (warm) page cache rather than the first one paying the disk."""
    from pathlib import Path

    buf = bytearray(16 << 20)
    total = 0
    root = Path(ckpt)
    for f in sorted(root.iterdir()) if root.is_dir() else [root]:
        if f.is_file():
            with open(f, "rb", buffering=0) as h:
                while n := h.readinto(buf):
                    total += n
    return total


def _trim() -> None:
    """Returns freed heap pages to the OS so the next baseline is honest."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class BenchGroup:
    """``world`` gloo ranks that run strategies one after another.

    ``run_strategy`` uses a fresh group per strategy (the figures in the
    README); the demo shares one group to stay quick.
    """

    def __init__(self, world: int, worker: Callable[..., None] | None = None) -> None:
        """``worker``: each rank's loop (default: the load bench's; ``save.py`` brings its own)."""
        ctx = mp.get_context("spawn")
        fd, self.init_file = tempfile.mkstemp(prefix="streamload_bench_pg_")
        os.close(fd)
        os.unlink(self.init_file)
        self.world = world
        self._inbox: dict[str, list[dict[str, Any]]] = {}
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=worker or _worker,
                args=(r, world, self.init_file, self.commands[r], self.results),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def _expect(self, kind: str, deadline: float) -> list[dict[str, Any]]:
        # Ranks run ahead of each other: keep messages of later kinds for later.
        while len(self._inbox.get(kind, [])) < self.world:
            k, payload = self.results.get(timeout=max(1.0, deadline - time.time()))
            if k == "error":
                raise _StrategyFailed(payload["error"])
            self._inbox.setdefault(k, []).append(payload)
        got = self._inbox.pop(kind)
        return sorted(got, key=lambda d: d["rank"])

    def run(
        self,
        strategy: str,
        ckpt: str,
        *,
        dtype: str = "bfloat16",
        verify: bool = True,
        timeout: float = 900.0,
        cold: bool = False,
        **opts: Any,
    ) -> RunResult:
        """Loads ``ckpt`` with ``strategy`` on every rank and measures it; ``cold``: from a
        cold page cache (the checkpoint evicted first, checked with mincore), else a warm one."""
        res = RunResult(strategy, self.world, ckpt, ok=False)
        deadline = time.time() + timeout
        self._inbox = {}
        for q in self.commands:
            q.put((strategy, ckpt, dtype, {**opts, "verify": verify}))
        sampler: MemorySampler | None = None
        try:
            self._expect("ready", deadline)
            if cold:
                from .cold import make_cold

                res.cold, res.resident_before = True, make_cold(ckpt)
            else:
                warm_page_cache(ckpt)
            time.sleep(0.3)  # let import-time allocations settle before the baseline
            sampler = MemorySampler([p.pid for p in self.procs if p.pid is not None])
            for q in self.commands:
                q.put("go")
            timed = self._expect("timed", deadline)
            sampler.stop()
            res.ok = True
            res.seconds = max(t["seconds"] for t in timed)
            res.peak_rss = [t["peak_rss"] for t in timed]
            res.shard_bytes = sum(t["shard_bytes"] for t in timed)
            res.file_backed_shard_bytes = sum(t["file_backed_shard_bytes"] for t in timed)
            res.touch_seconds = max(t["touch_seconds"] for t in timed)
            res.first_step_seconds = max(t["first_step_seconds"] for t in timed)
            res.cpu_seconds = [round(t["cpu_seconds"], 3) for t in timed]
            res.disk_bytes_read = [t["disk_bytes_read"] for t in timed]
            res.peak_anon_over_baseline = sampler.peak - sampler.baseline
            res.peak_anon_per_rank = [
                p - b for p, b in zip(sampler.rank_peak, sampler.rank_baseline, strict=True)
            ]
            res.system_anon_over_baseline = sampler.system_peak - sampler.system_baseline
            anon_shards = res.shard_bytes - res.file_backed_shard_bytes
            res.overhead_bytes = res.peak_anon_over_baseline - anon_shards
            res.bytes_moved = max(t["bytes_moved"] for t in timed) or res.shard_bytes
            res.gbps = res.bytes_moved / res.seconds / 1e9 if res.seconds else 0.0
            ties = {t["tie_held"] for t in timed}
            res.tie_held = None if ties == {None} else all(t is True for t in ties)
            res.timeline = sampler.timeline
            res.phases = next((t["phases"] for t in timed if t["rank"] == 0), {})
            if verify:
                verified = self._expect("verified", deadline)
                res.mismatched = verified[0]["mismatched"]
                res.correct = not res.mismatched
            self._expect("done", deadline)
        except _StrategyFailed as exc:
            res.ok, res.error = False, str(exc)
            try:
                # Ranks still waiting in the failed strategy's collectives never finish.
                self._expect("done", min(deadline, time.time() + 30))
            except (queue.Empty, _StrategyFailed):
                self.close(kill=True)
        except queue.Empty:
            res.ok, res.error = False, f"timed out after {timeout}s"
            self.close(kill=True)
        finally:
            if sampler is not None:
                sampler.stop()
        return res

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.commands:
                q.put(None)
        for p in self.procs:
            p.join(timeout=1 if kill else 60)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)


class _StrategyFailed(Exception):
    pass


def run_strategy(strategy: str, ckpt: str, world: int, **kwargs: Any) -> RunResult:
    """Loads ``ckpt`` with ``strategy`` on ``world`` fresh gloo ranks and measures it.

    Args:
        strategy, ckpt: see ``BenchGroup.run``.
        world: how many ranks.
        kwargs: ``BenchGroup.run``'s keywords (dtype, verify, timeout) and the strategy's options.

    Returns:
        The measured RunResult.
    """
    group = BenchGroup(world)
    try:
        return group.run(strategy, ckpt, **kwargs)
    finally:
        group.close()
