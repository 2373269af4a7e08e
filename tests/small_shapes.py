"""Shapes of the tiny synthetic checkpoints several test modules build (one copy)."""

from __future__ import annotations

from typing import Any

# A 2-layer qwen2-like dense model in 16 KB shards: many files, uneven shards at 3 ranks.
SMALL_DENSE: dict[str, Any] = dict(
    layers=2,
    vocab=97,
    hidden_size=24,
    intermediate_size=40,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_shard_size="16KB",
)
