"""accelerate's FSDP2 path with cpu_ram_efficient_loading, streamed.

accelerate.utils.fsdp_utils.fsdp2_prepare_model keeps rank 0's state dict,
moves the model to meta, applies fully_shard, then calls its own
fsdp2_load_full_state_dict(accelerator, model, original_sd), which
broadcasts every full tensor to every rank. Here the last call is
streamload's: each rank receives only its shard.

    torchrun --nproc-per-node 2 examples/accelerate_fsdp2.py
"""

from __future__ import annotations

import torch.distributed as dist
from _common import check, setup
from transformers import AutoModelForCausalLM

import streamload
from streamload.integrations.pretrained import default_shard_fn

args, mesh = setup()
model = AutoModelForCausalLM.from_pretrained(args.ckpt)  # accelerate: real on rank 0, meta elsewhere
original_sd = model.state_dict() if dist.get_rank() == 0 else {}
model = model.to("meta")  # fsdp2_prepare_model: "model.to(torch.device('meta'))"
default_shard_fn(model, mesh)  # fully_shard of the auto-wrap policy's modules, then the root
streamload.fsdp2_load_full_state_dict(model, original_sd, mesh)
check(model, args.ckpt)
