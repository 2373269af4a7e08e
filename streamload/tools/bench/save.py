"""`streamload bench --save`: ways of writing a sharded model as a Hugging Face checkpoint, side by side.

Every rank group loads the checkpoint once (streamload, ``readers="owners"``) and then saves the
sharded model with each strategy in turn, into a fresh directory each time. A run is timed from
the moment every rank is told to go until a loadable checkpoint exists and every file and
directory in it is fsynced (a strategy that does not fsync is fsynced after it, inside the timed
span, so that every figure counts the same durable bytes). Beside the time, each run records
each rank's peak anonymous memory over its baseline (RssAnon sampled every 10 ms, as the load
bench does), the bytes the ranks wrote (``/proc/self/io`` ``write_bytes``, summed over ranks) and
the size of what is left on disk, and before each run the disk's sequential write bandwidth: the
checkpoint's size written in large blocks into the same file system and fsynced.

The output of every strategy is checked: transformers' ``from_pretrained`` loads it and every
tensor of its state dict equals the saved model's full tensor bit for bit; the key names are
compared with the source checkpoint's (hub names: per-expert MoE tensors, not the model's fused
ones).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import queue
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .runner import BenchGroup, MemorySampler, _StrategyFailed, _trim, mismatched
from .save_strategies import CLIENT_SAVERS, SAVE_STRATEGIES, SAVERS, saver_fn
from .table import MiB, baseline_row, render_table, write_jsonl


def fsync_tree(path: str) -> None:
    """fsyncs every regular file under ``path``, then every directory bottom up, then its parent
    (the entry naming ``path``): what a checkpoint needs to survive a crash."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files + dirs:
            p = os.path.join(root, name)
            if os.path.isfile(p) and not os.path.islink(p):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(root)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def io_write_bytes() -> int:
    """Bytes this process has caused to be written to storage so far (``/proc/self/io``
    ``write_bytes``, counted when a page is dirtied; 0 on file systems without a backing device)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("write_bytes not in /proc/self/io")


def tree_bytes(path: str) -> tuple[int, int]:
    """(bytes, safetensors files) of every regular file under ``path``."""
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            p = os.path.join(root, name)
            if os.path.isfile(p) and not os.path.islink(p):
                total += os.path.getsize(p)
                files += name.endswith(".safetensors")
    return total, files


@dataclass
class WriteBandwidth:
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def write_bandwidth(directory: str, nbytes: int, block: int = 64 * MiB) -> WriteBandwidth:
    """The disk's sequential write bandwidth: ``nbytes`` written into a new file in ``directory``
    in ``block``-sized writes and fsynced (random bytes, so a compressing file system cannot
    cheat); the file is removed after.

    Example:
        >>> write_bandwidth("/tmp", 256 << 20).gbps
    """
    os.makedirs(directory, exist_ok=True)
    buf = memoryview(os.urandom(min(block, max(nbytes, 1))))
    path = os.path.join(directory, f".streamload_write_probe_{os.getpid()}")
    os.sync()  # earlier dirty pages are not this write's to flush
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(directory)
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return WriteBandwidth(nbytes, seconds)


def checkpoint_bytes(ckpt: str) -> int:
    """Size of the checkpoint's safetensors files: the bytes a save writes."""
    return sum(p.stat().st_size for p in Path(ckpt).glob("*.safetensors"))


def _headers(path: str) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the top-level safetensors files of ``path``: name -> (stored dtype, shape)."""
    from safetensors import safe_open

    out: dict[str, tuple[str, list[int]]] = {}
    for p in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), list(sl.get_shape()))
    return out


def _verify(model: nn.Module, out: str, ckpt: str, dtype: torch.dtype, rank: int) -> dict[str, Any]:
    """The saved checkpoint against the model: rank 0 loads it with transformers'
    ``from_pretrained``; every tensor of the model's state dict is gathered (one at a time, every
    rank) and compared bit for bit. Returns the mismatched names, whether it loaded and whether its
    key names are the source checkpoint's (hub names)."""
    import torch.distributed as dist

    from .strategies import quiet_from_pretrained

    ref: dict[str, torch.Tensor] = {}
    error = ""
    if rank == 0:
        try:
            ref = quiet_from_pretrained(out, dtype).state_dict()
        except Exception as exc:  # noqa: BLE001 - an unloadable output is a result
            error = f"{type(exc).__name__}: {exc}"
    failed = [error]
    dist.broadcast_object_list(failed, src=0)  # every rank stops together
    if failed[0]:
        return {
            "loadable": False,
            "mismatched": [failed[0][:300]],
            "hub_names": None,
            "extra_keys": [],
            "missing_keys": [],
            "key_counts": (0, 0),
        }
    bad = mismatched(list(model.state_dict().items()), ref, rank)
    heads, source = (_headers(out), _headers(ckpt)) if rank == 0 else ({}, {})
    # from_pretrained casts to the dtype asked for: the stored dtypes and shapes are checked apart.
    bad += [
        f"{k} (stored {heads[k][0]} {heads[k][1]}, source {v[0]} {v[1]})"
        for k, v in source.items()
        if k in heads and heads[k] != v
    ]
    got, want = set(heads), set(source)
    return {
        "loadable": True,
        "mismatched": bad,
        "hub_names": got == want if rank == 0 else None,
        # e.g. a tied head written twice, or fused expert names where the hub has per-expert ones
        "extra_keys": sorted(got - want)[:20],
        "missing_keys": sorted(want - got)[:20],
        "key_counts": (len(got - want), len(want - got)),
    }


def _load_model(ckpt: str, mesh: Any, dtype: torch.dtype) -> nn.Module:
    import streamload

    return streamload.from_pretrained(ckpt, device_mesh=mesh, dtype=dtype, progress=False, readers="owners")


def _save_worker(rank: int, world: int, init_file: str, commands: Any, results: Any) -> None:
    """One rank: loads the model once, then runs each save it is sent (see ``SaveGroup.run``)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model: nn.Module | None = None
    ckpt, dtype = "", torch.bfloat16
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        try:
            if cmd[0] == "load":
                _, ckpt, dtype_name = cmd
                dtype = getattr(torch, dtype_name)
                model = _load_model(ckpt, mesh, dtype)
                results.put(("loaded", {"rank": rank}))
                continue
            _, strategy, out, verify, opts = cmd
            save = saver_fn(strategy)
            # Import cost is not save cost.
            importlib.import_module(
                "streamload" if strategy.startswith("streamload") else "torch.distributed.checkpoint"
            )
            gc.collect()
            _trim()
            results.put(("ready", {"rank": rank}))
            commands.get()  # go
            assert model is not None, "no model loaded"
            io0 = io_write_bytes()
            t0 = time.perf_counter()
            report = save(model, out, opts)
            dist.barrier()
            if rank == 0:
                fsync_tree(out)
            dist.barrier()
            seconds = time.perf_counter() - t0
            phases = dict(getattr(report, "phases", None) or {})
            results.put(("timed", {"rank": rank, "seconds": seconds, "write_bytes": io_write_bytes() - io0}))
            if verify:
                results.put(
                    ("verified", {"rank": rank, "phases": phases, **_verify(model, out, ckpt, dtype, rank)})
                )
        except BaseException as exc:  # noqa: BLE001 - a failing strategy is a result, not a crash
            results.put(
                (
                    "error",
                    {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()},
                )
            )
        gc.collect()
        _trim()
        results.put(("done", {"rank": rank}))
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class SaveResult:
    strategy: str
    world: int
    checkpoint: str
    ok: bool
    error: str | None = None
    seconds: float = 0.0  # go -> every rank done, the output fsynced
    peak_anon_per_rank: list[int] = field(default_factory=list)  # each rank's peak RssAnon over its baseline
    peak_anon_max: int = 0  # the largest of them
    peak_anon_over_baseline: int = 0  # the ranks' RssAnon together
    write_bytes: list[int] = field(default_factory=list)  # per rank, /proc/self/io write_bytes
    disk_bytes_written: int = 0  # their sum
    output_bytes: int = 0  # every regular file the save left under its directory
    output_files: int = 0  # safetensors files among them (DCP's sharded copy included)
    checkpoint_bytes: int = 0  # the source checkpoint's safetensors bytes (the write probe's size)
    disk_write_seconds: float = 0.0  # the probe: checkpoint_bytes written sequentially and fsynced
    disk_write_gbps: float = 0.0
    correct: bool | None = None
    loadable: bool | None = None  # transformers' from_pretrained loads the output
    hub_names: bool | None = None  # its key names are the source checkpoint's
    extra_keys: list[str] = field(default_factory=list)  # in the output, not in the source (first 20)
    missing_keys: list[str] = field(default_factory=list)  # in the source, not in the output (first 20)
    extra_key_count: int = 0
    missing_key_count: int = 0
    mismatched: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # rank 0's SaveReport.phases (streamload)
    timeline: list[tuple[float, int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SaveGroup:
    """``world`` gloo ranks holding one sharded model, saving it with one strategy after another."""

    def __init__(self, world: int, ckpt: str, dtype: str, timeout: float = 900.0) -> None:
        self.world, self.ckpt, self.dtype, self.timeout = world, ckpt, dtype, timeout
        self.group = self._start()

    def _start(self) -> BenchGroup:
        group = BenchGroup(self.world, worker=_save_worker)
        for q in group.commands:
            q.put(("load", self.ckpt, self.dtype))
        try:
            group._expect("loaded", time.time() + self.timeout)
        except BaseException:
            group.close(kill=True)
            raise
        return group

    def run(
        self, strategy: str, out: str, *, verify: bool, timeout: float = 900.0, **opts: Any
    ) -> SaveResult:
        """Saves the model into the fresh directory ``out`` with ``strategy`` and measures it.
        After a failure the ranks are replaced (a rank stuck in a collective never returns)."""
        res = SaveResult(strategy, self.world, self.ckpt, ok=False)
        group = self.group
        deadline = time.time() + timeout
        group._inbox = {}
        for q in group.commands:
            q.put(("save", strategy, out, verify, opts))
        sampler: MemorySampler | None = None
        try:
            group._expect("ready", deadline)
            os.sync()  # the previous run's dirty pages are not this one's to write
            time.sleep(0.3)  # let import-time allocations settle before the baseline
            sampler = MemorySampler([p.pid for p in group.procs if p.pid is not None])
            for q in group.commands:
                q.put("go")
            timed = group._expect("timed", deadline)
            sampler.stop()
            res.ok = True
            res.seconds = max(t["seconds"] for t in timed)
            res.write_bytes = [t["write_bytes"] for t in timed]
            res.disk_bytes_written = sum(res.write_bytes)
            res.peak_anon_per_rank = [
                p - b for p, b in zip(sampler.rank_peak, sampler.rank_baseline, strict=True)
            ]
            res.peak_anon_max = max(res.peak_anon_per_rank, default=0)
            res.peak_anon_over_baseline = sampler.peak - sampler.baseline
            res.timeline = sampler.timeline
            res.output_bytes, res.output_files = tree_bytes(out)
            if verify:
                v = group._expect("verified", deadline)[0]
                res.mismatched, res.loadable, res.hub_names = v["mismatched"], v["loadable"], v["hub_names"]
                res.phases, res.extra_keys, res.missing_keys = v["phases"], v["extra_keys"], v["missing_keys"]
                res.extra_key_count, res.missing_key_count = v["key_counts"]
                res.correct = res.loadable and not res.mismatched
            group._expect("done", deadline)
        except _StrategyFailed as exc:
            res.ok, res.error = False, str(exc)
            self._settle(min(deadline, time.time() + 30))
        except queue.Empty:  # a rank that never answered
            res.ok, res.error = False, f"timed out after {timeout}s"
            self._replace()
        finally:
            if sampler is not None:
                sampler.stop()
        return res

    def _settle(self, deadline: float) -> None:
        """After a failure: waits until every rank is out of the strategy (a failure raised on every
        rank, as streamload's SaveError is, leaves the group usable); ranks that never come out are
        stuck in a collective and are replaced."""
        done = len(self.group._inbox.get("done", []))
        try:
            while done < self.world:
                kind, _ = self.group.results.get(timeout=max(0.1, deadline - time.time()))
                done += kind == "done"
        except queue.Empty:
            self._replace()

    def _replace(self) -> None:
        self.group.close(kill=True)
        self.group = self._start()

    def close(self) -> None:
        self.group.close()


def median_save(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from repeated runs of one strategy: the median run (by save time) with the median
    and min-max of the time, the memory and the disk probe; failed runs only if all failed."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return dict(runs[0])
    row = dict(sorted(ok, key=lambda r: r["seconds"])[len(ok) // 2])
    for key in ("seconds", "peak_anon_max", "disk_write_seconds", "disk_write_gbps"):
        values = sorted(r[key] for r in ok)
        row[key] = statistics.median(values)
        row[key + "_spread"] = (values[0], values[-1])
    row["runs"] = len(ok)
    verified = [r for r in runs if r.get("correct") is not None]
    row["correct"] = all(r["correct"] for r in verified) if verified else None
    # The names as the verified run (the first repeat) found them, whichever run is the median.
    named = [r for r in runs if r.get("hub_names") is not None]
    if named:
        for key in ("hub_names", "extra_keys", "missing_keys", "extra_key_count", "missing_key_count"):
            if key in named[0]:
                row[key] = named[0][key]
    return row


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if abs(n) < 10 * MiB else f"{n / MiB:.0f} MiB"


def _names(d: dict[str, Any]) -> str:
    """The hub-names cell: yes, or how many keys the output has beyond and short of the source's."""
    if d.get("hub_names") is None:
        return "-"
    if d["hub_names"]:
        return "yes"
    extra, missing = d.get("extra_keys", []), d.get("missing_keys", [])
    first = f"+{extra[0]}" if extra else f"-{missing[0]}" if missing else ""
    return (
        f"no (+{d.get('extra_key_count', len(extra))} -{d.get('missing_key_count', len(missing))}: {first})"
    )


def save_table(rows: Sequence[dict[str, Any]], group_keys: Sequence[str], baseline: str = "rank0") -> str:
    """One line per strategy and rank count (see docs/benchmarks.md, "Save")."""
    head = [
        *group_keys,
        "ranks",
        "strategy",
        "save s (min-max)",
        "disk write s (GB/s)",
        "vs disk write",
        "vs " + baseline,
        "peak anon max rank",
        "peak anon rank 0",
        "bytes written",
        "output",
        "hub names",
        "correct",
    ]

    def cells(d: dict[str, Any]) -> list[str]:
        lo, hi = d.get("seconds_spread") or (d["seconds"], d["seconds"])
        base = baseline_row(rows, d, baseline, group_keys)
        disk = d.get("disk_write_seconds", 0.0)
        per_rank = d.get("peak_anon_per_rank") or [0]
        return [
            f"{d['seconds']:.2f} ({lo:.2f}-{hi:.2f})",
            f"{disk:.2f} ({d.get('disk_write_gbps', 0.0):.2f})",
            f"{d['seconds'] / disk:.2f}x" if disk else "-",
            f"{d['seconds'] / base['seconds']:.2f}x" if base and base["seconds"] else "-",
            _mib(d["peak_anon_max"]),
            _mib(per_rank[0]),
            _mib(d["disk_bytes_written"]),
            f"{_mib(d['output_bytes'])} in {d['output_files']} files",
            _names(d),
            str(d.get("correct")),
        ]

    return render_table(head, rows, group_keys, cells)


def run_save(args: argparse.Namespace, ckpt: str, label: str) -> int:
    """``streamload bench --save``: each strategy saves the same sharded model, per rank count,
    ``--repeat`` times (strategies take turns within a repeat); writes results.jsonl (medians),
    runs.jsonl (every run) and table.md to ``--out``."""
    if args.cold or args.options or args.read_mode or args.bucket_mib:
        # The loads before the saves are the bench's own: a load option would measure nothing.
        raise SystemExit(
            "--save measures saves: --cold, --options, --read-mode and --bucket-mib do not apply"
        )
    strategies = args.strategies or SAVE_STRATEGIES
    # A client's own export by name, or any "module:function".
    unknown = [s for s in strategies if s not in SAVERS and s not in CLIENT_SAVERS and ":" not in s]
    if unknown:
        raise SystemExit(
            f"--save: unknown strategies {unknown}; one of {SAVE_STRATEGIES + list(CLIENT_SAVERS)} or module:function"
        )
    os.makedirs(args.out, exist_ok=True)
    save_root = args.save_dir or tempfile.mkdtemp(prefix="streamload_bench_save_", dir=args.out)
    os.makedirs(save_root, exist_ok=True)
    nbytes = checkpoint_bytes(ckpt)
    opts = {"max_shard_size": args.max_shard_size}
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for world in args.ranks:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
        group = SaveGroup(world, ckpt, args.dtype)
        try:
            for rep in range(max(1, args.repeat)):
                for strategy in strategies:
                    out = os.path.join(save_root, f"{strategy}-{world}r-{rep}")
                    shutil.rmtree(out, ignore_errors=True)
                    bw = write_bandwidth(save_root, nbytes)
                    # The correctness pass runs on the first repeat, as the load bench's does.
                    r = group.run(strategy, out, verify=not args.no_verify and rep == 0, **opts)
                    r.checkpoint_bytes, r.disk_write_seconds, r.disk_write_gbps = nbytes, bw.seconds, bw.gbps
                    shutil.rmtree(out, ignore_errors=True)  # the disk holds one output at a time
                    row = {**r.to_dict(), "label": label, "repeat": rep}
                    runs[strategy].append(row)
                    status = "ok" if r.ok else f"FAILED ({r.error})"
                    print(
                        f"{label} ranks={world} save {strategy} #{rep + 1}: {r.seconds:.2f}s "
                        f"(disk write {bw.seconds:.2f}s = {bw.gbps:.2f} GB/s), "
                        f"peak anon/rank {r.peak_anon_max / MiB:.0f} MiB, "
                        f"written {r.disk_bytes_written / MiB:.0f} MiB, output {r.output_bytes / MiB:.0f} MiB, "
                        f"hub names={r.hub_names}, correct={r.correct}: {status}",
                        flush=True,
                    )
        finally:
            group.close()
        raw.extend(row for s in strategies for row in runs[s])
        rows.extend(median_save(runs[s]) for s in strategies)
    if not args.save_dir:
        shutil.rmtree(save_root, ignore_errors=True)
    write_jsonl(Path(args.out) / "results.jsonl", rows)
    write_jsonl(Path(args.out) / "runs.jsonl", raw)
    table = save_table(rows, ["label"])
    (Path(args.out) / "table.md").write_text(table + "\n")
    print(table)
    print(f"wrote {Path(args.out) / 'results.jsonl'}, {Path(args.out) / 'table.md'}")
    return 0
