"""Random-weight checkpoints from transformers config classes, for the demo,
tests and benchmarks (nothing is downloaded)."""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

import torch

# Small configs per architecture; sizes are scaled by `make_config`.
_ATTENTION: dict[str, Any] = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
_EXPERTS: dict[str, Any] = dict(num_experts=6, num_experts_per_tok=2)
BASE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(_ATTENTION, intermediate_size=64),
    "llama": dict(_ATTENTION, intermediate_size=64),
    "qwen3": dict(_ATTENTION, intermediate_size=64, head_dim=8),
    "qwen3_moe": dict(_ATTENTION, **_EXPERTS, intermediate_size=64, moe_intermediate_size=16, head_dim=8),
    "qwen2_moe": dict(
        _ATTENTION,
        **_EXPERTS,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    ),
    "mixtral": dict(_ATTENTION, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2),
    "olmoe": dict(_ATTENTION, **_EXPERTS, intermediate_size=16),
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
    mis-mapped tensor could otherwise compare equal by accident). Parameters
    on meta are replaced by real ones; shared (tied) parameters stay shared."""
    gen = torch.Generator().manual_seed(seed)
    fresh: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in fresh:
                value = (torch.randn(p.shape, generator=gen) * 0.05 + 0.01).to(p.dtype)
                if p.is_meta:
                    fresh[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
                else:
                    p.copy_(value)
                    fresh[id(p)] = p
            module._parameters[name] = fresh[id(p)]
        # Persistent floating buffers are saved too (e.g. DeepSeek's
        # e_score_correction_bias): random values prove they are loaded.
        for name, b in list(module._buffers.items()):
            if (
                b is None
                or name in module._non_persistent_buffers_set
                or not b.is_floating_point()
                or b.is_meta
            ):
                continue
            b.copy_((torch.randn(b.shape, generator=gen) * 0.05).to(b.dtype))
    # accelerate's init_empty_weights re-registers tied parameters as separate
    # meta tensors; re-tie as transformers would.
    if hasattr(model, "tie_weights"):
        typing.cast(typing.Any, model).tie_weights()
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
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    cfg = config if config is not None else make_config(model_type, **config_kw)
    cfg.dtype = dtype
    # Parameters start on meta (no init cost); buffers are built for real.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    randomize_(model, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def sized_config(model_type: str, gb: float, *, tie: bool, dtype_bytes: int = 2, **overrides: Any):
    """A config whose checkpoint is about ``gb`` GB: the layer count is solved for."""
    big = dict(
        vocab=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4
    )
    if model_type in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral"):
        big = dict(vocab=8192, hidden_size=1024, num_attention_heads=8, num_key_value_heads=4)
        experts_key = "num_local_experts" if model_type == "mixtral" else "num_experts"
        big[experts_key] = overrides.pop("experts", 64)
        big["num_experts_per_tok"] = 4
        inter = overrides.pop("expert_intermediate", None)
        if model_type in ("qwen3_moe", "qwen2_moe"):
            big["moe_intermediate_size"] = inter or 256
            big["intermediate_size"] = 2048
            if model_type == "qwen3_moe":
                big["head_dim"] = 128 if gb >= 0.5 else 32
            if model_type == "qwen2_moe":
                big["shared_expert_intermediate_size"] = 1024
        else:
            big["intermediate_size"] = inter or 256
    big.update(overrides)
    one = make_config(model_type, layers=1, tie=tie, **big)
    two = make_config(model_type, layers=2, tie=tie, **big)
    per_layer = _param_count(two) - _param_count(one)
    fixed = _param_count(one) - per_layer
    layers = max(1, round((gb * 1e9 / dtype_bytes - fixed) / per_layer))
    return make_config(model_type, layers=layers, tie=tie, **big)


def _param_count(cfg: Any) -> int:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        m = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in m.parameters())
