"""verl's actor build, with streamload's fsdp2_load_full_state_dict.

The sequence of verl/workers/fsdp_workers.py (_build_model_optimizer) and
verl/utils/fsdp_utils.py, in plain torch and transformers:
  rank 0: from_pretrained, then state_dict(); other ranks: meta init (now
  also for tied models: the tie_word_embeddings guard is dropped, so the
  model is tied again before sharding: init_empty_weights leaves it untied);
  fully_shard every decoder layer, then the root (apply_fsdp2);
  fsdp2_load_full_state_dict(model, full_state, device_mesh, cpu_offload).

    torchrun --nproc-per-node 2 examples/verl_fsdp2.py

verl's own engine with streamload swapped in (needs verl): tests/test_client_verl.py, docs/clients/verl.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _common import check, setup
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

import streamload
from streamload.integrations.pretrained import default_shard_fn

args, mesh = setup()
config = AutoConfig.from_pretrained(args.ckpt)
dtype = torch.float32  # verl keeps fp32 master weights
if dist.get_rank() == 0:
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=dtype)
    full_state = model.state_dict()
else:
    with init_empty_weights():  # no longer skipped for tie_word_embeddings=True
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    full_state = model.state_dict()
model.tie_weights()  # else lm_head is its own FSDP parameter on ranks >= 1: streamload raises TieError
default_shard_fn(model, mesh)  # verl's apply_fsdp2: every decoder layer, then the root
streamload.fsdp2_load_full_state_dict(model, full_state, mesh, cpu_offload=None)
del full_state
check(model, args.ckpt, dtype)
