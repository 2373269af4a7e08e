"""Shared setup for the integration examples: a process group, a small
checkpoint, and a check against transformers. Run an example with e.g.

    torchrun --nproc-per-node 2 examples/verl_fsdp2.py [--ckpt DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
import torch.distributed as dist


def setup() -> tuple[argparse.Namespace, object]:
    """Initialises torch.distributed (NCCL with GPUs, else gloo) and a 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--ckpt", default=None, help="checkpoint directory (default: a generated tiny tied model)"
    )
    ap.add_argument("--model-type", default="qwen2")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    if args.ckpt is None:
        box = [None]
        if dist.get_rank() == 0:
            from streamload.tools.synthetic import make_checkpoint

            kw = {"num_experts": 6} if "moe" in args.model_type else {}
            box[0] = str(
                make_checkpoint(
                    tempfile.mkdtemp(prefix="streamload_example_"),
                    args.model_type,
                    tie=True,
                    seed=7,
                    layers=2,
                    vocab=96,
                    hidden_size=32,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_shard_size="16KB",
                    **kw,
                )
            )
        dist.broadcast_object_list(box, src=0)
        args.ckpt = box[0]
    return args, mesh


def check(model: torch.nn.Module, ckpt: str, dtype: torch.dtype | None = None) -> None:
    """Every parameter against transformers (on rank 0), and the tie on every rank."""
    from transformers import AutoModelForCausalLM

    ref = None
    if dist.get_rank() == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype or "auto").named_parameters())
    bad = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if ref is not None and not torch.equal(full.detach().cpu(), ref[name].detach()):
            bad.append(name)
    tie = model.lm_head.weight is model.get_input_embeddings().weight
    assert not bad, f"differ from transformers: {bad}"
    assert tie or not model.config.tie_word_embeddings, "tie lost"
    if dist.get_rank() == 0:
        print(f"OK: every parameter equals transformers' from_pretrained; tie held: {tie}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
