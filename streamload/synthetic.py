"""Random-weight checkpoints from transformers config classes, for the demo,
tests and benchmarks (nothing is downloaded)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

# Small configs per architecture; sizes are scaled by `make_config`.
BASE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2),
    "llama": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8
    ),
    "qwen3_moe": dict(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
    ),
    "mixtral": dict(
        hidden_size=32,
        intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=6,
        num_experts_per_tok=2,
    ),
    "olmoe": dict(
        hidden_size=32,
        intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
    ),
    "gpt2": dict(n_embd=32, n_head=4, n_positions=64),
}


def make_config(model_type: str, *, layers: int = 2, vocab: int = 128, tie: bool = False, **overrides: Any):
    """Returns a transformers config for a small random model of ``model_type``."""
    from transformers import AutoConfig

    kw = dict(BASE_CONFIGS.get(model_type, {}))
    if model_type == "gpt2":
        kw.update(n_layer=layers)
    else:
        kw.update(num_hidden_layers=layers)
    kw.update(vocab_size=vocab, tie_word_embeddings=tie)
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Gives every parameter distinct random values (norms start as ones, so a
    mis-mapped tensor could otherwise compare equal by accident)."""
    gen = torch.Generator().manual_seed(seed)
    for _name, p in model.named_parameters():
        p.copy_((torch.randn(p.shape, generator=gen) * 0.05 + 0.01).to(p.dtype))
    return model


def make_checkpoint(
    out_dir: str | os.PathLike,
    model_type: str = "qwen2",
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    max_shard_size: str | int = "5GB",
    config: Any = None,
    **config_kw: Any,
) -> Path:
    """Writes a random-weight checkpoint with transformers' ``save_pretrained``.

    Args:
        out_dir: destination directory (created).
        model_type: a transformers model type, e.g. ``"qwen2"``, ``"qwen3_moe"``.
        dtype: dtype of the saved weights.
        seed: random seed.
        max_shard_size: passed to ``save_pretrained`` (small values give sharded checkpoints).
        config: a ready config (else built by ``make_config(model_type, **config_kw)``).

    Returns:
        The checkpoint directory.
    """
    from transformers import AutoModelForCausalLM

    cfg = config if config is not None else make_config(model_type, **config_kw)
    cfg.dtype = dtype
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    randomize_(model, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out
