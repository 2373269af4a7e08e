"""One rank of the fault-injection run (tests/test_faults.py launches three
as separate processes). For each fault it loads a broken checkpoint, or
injects a failure mid-stream, and records which error this rank raised and
how long after the load started."""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

import streamload
import streamload.load.prepare as sl_prepare
import streamload.transport.strategies as sl_strategies
import streamload.transport.stream as sl_load
from streamload.transport.pack import Packer

# Pre-stream steps that run after the placement all-gather, and the rank that fails in each.
PRE_STREAM = {"plan_raise": 1, "map_raise": 2, "node_groups_raise": 1}


def inject(fault: str, rank: int, ckpt: str):
    """Installs a mid-stream failure; returns an undo function."""
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

    real_plan, real_map, real_group = sl_prepare.build_plan, sl_prepare.map_shards, sl_strategies.node_group
    if PRE_STREAM.get(fault) == rank:
        if fault == "plan_raise":

            def build_plan(*args, **kwargs):
                raise RuntimeError(f"injected failure planning on rank {rank}")

            sl_prepare.build_plan = build_plan
        if fault == "map_raise":

            def map_shards(*args, **kwargs):
                raise streamload.CheckpointFileError(f"injected failure mapping shards on rank {rank}", ckpt)

            sl_prepare.map_shards = map_shards
        if fault == "node_groups_raise":

            def node_group(global_ranks, backend=None):
                # The collective itself must still be matched; the failure comes after it.
                dist.destroy_process_group(real_group(global_ranks, backend))
                raise RuntimeError(f"injected failure creating node group {global_ranks} on rank {rank}")

            sl_strategies.node_group = node_group

    def undo() -> None:
        Packer.pack = real_pack  # type: ignore[method-assign]
        sl_load.unpack = real_unpack
        sl_prepare.build_plan, sl_prepare.map_shards, sl_strategies.node_group = (
            real_plan,
            real_map,
            real_group,
        )
        os.environ.pop("STREAMLOAD_NODE", None)

    return undo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--cases", required=True, help="JSON: [[fault, checkpoint dir], ...]")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=args.world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (args.world,))
    with open(args.out, "w") as out:
        for fault, ckpt in json.loads(args.cases):
            undo = inject(fault, args.rank, ckpt)
            dist.barrier()
            t0 = time.perf_counter()
            row = {"fault": fault, "rank": args.rank, "raised": None}
            try:
                readers, path = "auto", ckpt if args.rank == 0 else "/nonexistent/on/this/node"
                if fault.startswith("owners_"):  # every rank sees the files and reads its own shards
                    readers, path = "owners", ckpt
                    if fault == "owners_mismatched_copy" and args.rank == 2:
                        path = ckpt + "_other"  # this rank's copy differs from the reader's
                if fault in PRE_STREAM:  # every rank sees the files: owners (mapping) or node mode
                    readers, path = ("node" if fault == "node_groups_raise" else "auto"), ckpt
                    os.environ["STREAMLOAD_NODE"] = "a" if args.rank < 2 else "b"
                streamload.from_pretrained(
                    path, device_mesh=mesh, bucket_bytes=4096, progress=False, readers=readers
                )
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
            row["seconds"] = time.perf_counter() - t0
            out.write(json.dumps(row) + "\n")
            out.flush()
    # Tear down together: a rank that destroys its group while a peer is still
    # finishing the last collective can abort in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
