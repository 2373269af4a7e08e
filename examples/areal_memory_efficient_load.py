"""AReaL's FSDPEngine with fsdp.memory_efficient_load, streamed.

areal/engine/fsdp_engine.py (AReaL 1.0.4) builds the model with from_config on
rank 0 (meta elsewhere), loads the raw checkpoint into it with
load_state_dict(strict=False) (per-expert MoE checkpoints: the fused experts
stay random, with only a warning), applies apply_fsdp2, then calls
areal.engine.fsdp_utils.fsdp2_load_full_state_dict(model, full_state,
cpu_offload, tie_word_embeddings=...). streamload's AReaL entry has that
signature; given the checkpoint directory on rank 0 (a path, opened inside the
load's agreement, so a bad checkpoint is an error on every rank) it fuses the
experts from the files, and no rank materialises the model.

    torchrun --nproc-per-node 2 examples/areal_memory_efficient_load.py
"""

from __future__ import annotations

import torch.distributed as dist
from _common import check, setup
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

import streamload
from streamload.integrations.pretrained import default_shard_fn

args, mesh = setup()
config = AutoConfig.from_pretrained(args.ckpt)
with init_empty_weights():  # every rank on meta: streamload reads the files on rank 0
    model = AutoModelForCausalLM.from_config(config)
full_state = args.ckpt if dist.get_rank() == 0 else {}
default_shard_fn(model, mesh)  # apply_fsdp2
streamload.areal_fsdp2_load_full_state_dict(
    model, full_state, None, tie_word_embeddings=config.tie_word_embeddings
)
check(model, args.ckpt)
