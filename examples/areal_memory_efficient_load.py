"""AReaL's FSDPEngine with fsdp.memory_efficient_load, streamed.

areal/engine/fsdp_engine.py builds the model on rank 0 only (meta
elsewhere), applies apply_fsdp2, then calls
areal.utils.fsdp.fsdp2_load_full_state_dict(model, full_state, cpu_offload,
tie_word_embeddings). streamload's drop-in needs no tie flag: ties are
recorded and re-bound on every rank.

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
if dist.get_rank() == 0:
    model = AutoModelForCausalLM.from_pretrained(args.ckpt)
    full_state = model.state_dict()
else:
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.ckpt))
    full_state = {}
default_shard_fn(model, mesh)  # apply_fsdp2
streamload.fsdp2_load_full_state_dict(model, full_state, mesh, cpu_offload=None)
check(model, args.ckpt)
