"""A small in-repo multi-rank harness: N gloo processes started once, then
many cases run in them (importing torch and transformers costs seconds per
process, so a test module pays it once).

A case is a module-level function ``fn(rank, world, **kwargs)`` run on every
rank at once; its return values come back as a list, its exceptions as a
CaseError with each failing rank's traceback. A case that does not finish in
time kills the group, so a hang is a failure, never a stuck test run.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from typing import Any


class CaseError(AssertionError):
    pass


def _worker(rank: int, world: int, init_file: str, commands: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A hung rank's stacks (every thread) go to stderr when the parent gives up on it.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # Ctrl-C as in a torchrun rank, however the test run was started (a shell's background job
    # inherits SIGINT ignored, and Python then installs no handler: the interrupt cases need it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        module, name, kwargs = cmd
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(rank, world, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    # Tear down together: a rank that destroys its group while a peer is still
    # finishing the last collective can abort in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


class RankGroup:
    """``world`` spawned gloo ranks that run cases on demand."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        world = self.world
        fd, self.init_file = tempfile.mkstemp(prefix="streamload_pg_")
        os.close(fd)
        os.unlink(self.init_file)
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, world, self.init_file, self.commands[r], self.results), daemon=True
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
        """Runs ``fn`` on every rank; returns the per-rank results. A group killed by an
        earlier hang is started afresh first (one hang fails one case, not the module)."""
        if not any(p.is_alive() for p in self.procs):
            self._start()
        for q in self.commands:
            q.put((fn.__module__, fn.__name__, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        end = time.monotonic() + timeout
        while len(out) + len(errors) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=min(1.0, max(0.01, end - time.monotonic())))
            except queue.Empty:
                hung = sorted(set(range(self.world)) - set(out) - set(errors))
                dead = [r for r in hung if not self.procs[r].is_alive()]
                if not dead and time.monotonic() < end:
                    continue
                # A rank that died (its peers may wait for it in a collective) or the time is up.
                why = (
                    f"rank(s) {dead} died (exit codes {[self.procs[r].exitcode for r in dead]})"
                    if dead
                    else ""
                )
                self._dump_stacks([r for r in hung if r not in dead])
                self.close(kill=True)
                raise CaseError(
                    f"{fn.__name__}: ranks {hung} did not finish "
                    + (f"- {why}" if dead else f"within {timeout}s (hang)")
                    + "; the live ones' stacks are in the captured stderr"
                ) from None
            (out if ok else errors)[rank] = value
        if errors:
            raise CaseError(
                f"{fn.__name__} failed on ranks {sorted(errors)}:\n"
                + "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            )
        return [out[r] for r in range(self.world)]

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Asks each hung rank for its threads' stacks (faulthandler, on stderr) before the kill."""
        asked = False
        for r in ranks:
            pid = self.procs[r].pid
            if self.procs[r].is_alive() and pid is not None:
                print(
                    f"--- rank {r} (pid {pid}) did not finish; its stacks: ---", file=sys.stderr, flush=True
                )
                os.kill(pid, signal.SIGUSR1)
                asked = True
        if asked:
            time.sleep(2.0)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.commands:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)
