"""torchtitan's initial load of a Hugging Face checkpoint, streamed.

torchtitan builds the model on meta, parallelizes it (fully_shard), calls
model.to_empty(device) and init_weights(), then loads HF safetensors with
DCP (checkpoint.initial_load_in_hf -> HuggingFaceStorageReader), where every
rank reads its slices of every file. Here the model is a transformers model
built the same way and streamload.load_checkpoint does the load: only rank 0
reads, MoE experts are fused on the fly, ties and buffers are restored.
torchtitan's own model classes load with `load_checkpoint(model, path,
mapping=sd_adapter)`: see docs/clients/torchtitan.md and
tests/test_client_torchtitan.py.

    torchrun --nproc-per-node 2 examples/torchtitan_hf_load.py --model-type qwen3_moe
"""

from __future__ import annotations

import torch
from _common import check, setup
from transformers import AutoConfig, AutoModelForCausalLM

import streamload
from streamload.integrations.pretrained import default_shard_fn

args, mesh = setup()
config = AutoConfig.from_pretrained(args.ckpt)
with torch.device("meta"):  # torchtitan: model built on meta, buffers too
    model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
default_shard_fn(model, mesh)  # parallelize_fn: fully_shard blocks, then the root
report = streamload.load_checkpoint(model, args.ckpt, device_mesh=mesh)  # replaces to_empty + dcp.load
check(model, args.ckpt)
