"""Converters: model tensors that the checkpoint stores differently (fused
MoE experts and other transformers conversion-mapping operations)."""

from __future__ import annotations

from torch import nn

from .mapping import Converter


def converters_for(model: nn.Module) -> list[tuple[str, Converter]]:
    """Converters that apply to ``model`` (by its transformers model type)."""
    return []
