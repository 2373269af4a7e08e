"""One rank of the two-launch node test (tests/test_node_launches.py): the
first local rank of each launch sees the checkpoint, the others do not; the
load runs with readers="auto" over all ranks of both launches."""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import streamload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sees = os.environ["LOCAL_RANK"] == "0"
    model = streamload.from_pretrained(
        args.ckpt if sees else "/nonexistent/streamload/ckpt", device_mesh=mesh, progress=False
    )
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    bad: list[str] = []
    if rank == 0:
        from transformers import AutoModelForCausalLM

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype="auto")
        refs = dict(ref.named_parameters())
        bad = [
            n
            for n, t in full.items()
            if t.dtype != refs[n].dtype
            or not torch.equal(t.view(-1).view(torch.uint8), refs[n].view(-1).view(torch.uint8))
        ]
    result = {
        "rank": rank,
        "node": os.environ.get("GROUP_RANK"),
        "report": model.streamload_report.to_dict(),
        "tied": model.lm_head.weight is model.get_input_embeddings().weight,
        "bad": bad,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
