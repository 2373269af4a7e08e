"""One rank of the fault-injection run (tests/test_faults.py launches three as
separate processes). Each case either loads a broken checkpoint / injects a
named fault mid-stream (``fault``), or makes one step of the load raise on one
rank (``step``: a function or method the loader calls, found by test_faults.py
in the loader's source). It records which error this rank raised, how long
after the load started, and whether the injected step ran.

A case that does not finish within ``DEADLINE_S`` is a hang: the rank writes a
``HANG`` row (and every thread's stack in its log) and exits, so the run fails
fast instead of waiting for the process group's timeout. ``FAULT_DEADLINE_S``
overrides the deadline (shorter while exploring which steps hang).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import importlib
import inspect
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import streamload
import streamload.load.prepare as sl_prepare
import streamload.transport.stream as sl_load
from streamload.transport.pack import Packer

DEADLINE_S = float(os.environ.get("FAULT_DEADLINE_S", "45"))

# Pre-stream steps that run after the placement all-gather, and the rank that fails in each.
PRE_STREAM = {"plan_raise": 1, "map_raise": 2}


class InjectedFault(RuntimeError):
    """What an injected step raises (a RuntimeError, as an unexpected failure would be)."""


def inject(fault: str, rank: int, ckpt: str) -> Callable[[], None]:
    """Installs a named fault; returns an undo function."""
    real_pack, real_unpack = Packer.pack, sl_load.unpack
    calls = {"n": 0}
    if fault in ("src_raise_bucket", "src_interrupt", "truncated_while_loading") and rank == 0:

        def pack(self, bucket, slot):
            calls["n"] += 1
            if calls["n"] == 3:
                if fault == "src_raise_bucket":
                    raise streamload.CheckpointFileError("injected I/O error at bucket 2", ckpt, "bucket-2")
                if fault == "src_interrupt":
                    raise KeyboardInterrupt("injected interrupt at bucket 2")
            if fault == "truncated_while_loading" and calls["n"] == 2:
                victim = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))[-1]
                os.truncate(os.path.join(ckpt, victim), 64)
            return real_pack(self, bucket, slot)

        Packer.pack = pack  # type: ignore[method-assign]
    if fault in ("owners_raise_bucket", "owners_interrupt") and rank == 1:

        def pack(self, bucket, slot, only=None):
            if fault == "owners_raise_bucket":
                raise streamload.CheckpointFileError("injected I/O error on rank 1", ckpt, "bucket-0")
            raise KeyboardInterrupt("injected interrupt on rank 1")

        Packer.pack = pack  # type: ignore[method-assign]
    if fault == "receiver_raise" and rank == 2:

        def unpack(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected failure unpacking bucket 1 on rank 2")
            return real_unpack(*args, **kwargs)

        sl_load.unpack = unpack

    real_plan, real_map = sl_prepare.build_plan, sl_prepare.map_shards
    if PRE_STREAM.get(fault) == rank:
        if fault == "plan_raise":

            def build_plan(*args, **kwargs):
                raise RuntimeError(f"injected failure planning on rank {rank}")

            sl_prepare.build_plan = build_plan
        if fault == "map_raise":

            def map_shards(*args, **kwargs):
                raise streamload.CheckpointFileError(f"injected failure mapping shards on rank {rank}", ckpt)

            sl_prepare.map_shards = map_shards

    def undo() -> None:
        Packer.pack = real_pack  # type: ignore[method-assign]
        sl_load.unpack = real_unpack
        sl_prepare.build_plan, sl_prepare.map_shards = real_plan, real_map

    return undo


def resolve(step: str) -> tuple[Any, str]:
    """``"module:name"`` or ``"module:Class.method"`` -> (owner object, attribute name)."""
    module, _, qual = step.partition(":")
    owner: Any = importlib.import_module(module)
    *path, attr = qual.split(".")
    for p in path:
        owner = getattr(owner, p)
    return owner, attr


def inject_step(step: str, fired: dict[str, int], at: int = 1) -> Callable[[], None]:
    """Makes call number ``at`` of ``step`` on this rank raise InjectedFault (the other calls
    run it: what the loader does to recover, e.g. a launch replaced by one that moves zeros,
    is real); returns an undo function. ``fired["n"]`` counts the calls."""
    owner, attr = resolve(step)
    static = inspect.getattr_static(owner, attr)
    real = getattr(owner, attr)

    @functools.wraps(real)
    def failing(*args: Any, **kwargs: Any) -> Any:
        fired["n"] += 1
        if fired["n"] == at:
            raise InjectedFault(f"injected failure in {step} on rank {dist.get_rank()}")
        return real(*args, **kwargs)

    setattr(owner, attr, staticmethod(failing) if isinstance(static, staticmethod) else failing)

    def undo() -> None:
        setattr(owner, attr, static)

    return undo


def run_case(case: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    """Runs one case on this rank; returns its row."""
    ckpt = case["ckpt"]
    fault = case.get("fault")
    step = case.get("step")
    row: dict[str, Any] = {"id": case["id"], "rank": rank, "raised": None, "fired": 0}
    fired = {"n": 0}
    undo: Callable[[], None] = lambda: None  # noqa: E731
    readers = case.get("readers", "auto")
    if step is not None:
        path = ckpt if readers != "src" or rank == 0 else "/nonexistent/on/this/node"
        if rank == case["fail_rank"]:
            undo = inject_step(step, fired, case.get("at", 1))
    elif fault is None:  # a plain load (the run's first: imports and first-call costs)
        path = ckpt
    else:
        undo = inject(fault, rank, ckpt)
        path = ckpt if rank == 0 else "/nonexistent/on/this/node"
        if fault.startswith("owners_"):  # every rank sees the files and reads its own shards
            readers, path = "owners", ckpt
            if fault == "owners_mismatched_copy" and rank == 2:
                path = ckpt + "_other"  # this rank's copy differs from the reader's
        if fault in PRE_STREAM:  # every rank sees the files: owners (mapping)
            path = ckpt
    if readers == "node":  # two nodes: ranks 0 and 1, and rank 2
        os.environ["STREAMLOAD_NODE"] = "a" if rank < 2 else "b"
    dist.barrier()
    t0 = time.perf_counter()
    try:
        streamload.from_pretrained(path, device_mesh=mesh, bucket_bytes=4096, progress=False, readers=readers)
    except BaseException as exc:  # noqa: BLE001 - recording what each rank raised is the point
        row.update(
            raised=type(exc).__name__,
            message=str(exc),
            error_rank=getattr(exc, "rank", None),
            file=getattr(exc, "file", None),
            tensor=getattr(exc, "tensor", None),
            trace=traceback.format_exc()[-2000:],
        )
    finally:
        undo()
        os.environ.pop("STREAMLOAD_NODE", None)
    row["seconds"] = time.perf_counter() - t0
    row["fired"] = int(fired["n"] >= case.get("at", 1))  # the injected call was reached
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--cases", required=True, help="a JSON file: a list of case dicts (see run_case)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=args.world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (args.world,))
    with open(args.cases) as f:
        cases = json.load(f)
    with open(args.out, "w") as out:
        for case in cases:
            current = {
                "id": case["id"],
                "rank": args.rank,
                "raised": "HANG",
                "fired": -1,
                "seconds": DEADLINE_S,
            }

            def hang(row: dict[str, Any] = current) -> None:
                out.write(json.dumps(row) + "\n")
                out.flush()
                faulthandler.dump_traceback(all_threads=True)  # where it waits, in the rank's log
                os._exit(3)  # the other ranks are stuck too: each one's own deadline ends it

            watchdog = threading.Timer(DEADLINE_S, hang)
            watchdog.daemon = True
            watchdog.start()
            try:
                row = run_case(case, args.rank, mesh)
            finally:
                watchdog.cancel()
            out.write(json.dumps(row) + "\n")
            out.flush()
    # Tear down together: a rank that destroys its group while a peer is still
    # finishing the last collective can abort in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
