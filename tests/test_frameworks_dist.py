"""verl's call sequence with streamload's fsdp2_load_full_state_dict, and
what receiving ranks allocate."""

from __future__ import annotations

import cases_load as cases
import pytest
import torch
from rank_group import RankGroup
from small_shapes import SMALL_DENSE

from streamload.tools.synthetic import make_checkpoint

MiB = 1 << 20


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("verl")
    common = SMALL_DENSE
    return {
        "tied": str(make_checkpoint(root / "tied", "qwen2", tie=True, seed=21, **common)),
        "untied": str(make_checkpoint(root / "untied", "qwen2", tie=False, seed=22, **common)),
        "moe": str(
            make_checkpoint(
                root / "moe", "qwen3_moe", tie=True, seed=23, num_experts=5, max_shard_size="30KB"
            )
        ),
        # ~125 MB: big enough that shards and buckets dominate what the receivers allocate.
        "big": str(
            make_checkpoint(
                root / "big",
                "qwen2",
                tie=True,
                seed=24,
                layers=8,
                vocab=8192,
                hidden_size=768,
                intermediate_size=2304,
                num_attention_heads=8,
                num_key_value_heads=4,
            )
        ),
    }


@pytest.fixture(scope="module")
def group():
    g = RankGroup(3)
    yield g
    g.close()


@pytest.mark.parametrize("ws", [2, 3])
def test_verl_sequence(group: RankGroup, ckpts, ws: int) -> None:
    for name in ("tied", "untied", "moe"):
        for dtype in (torch.bfloat16, torch.float32):
            rep = group.run(cases.case_verl_sequence, ckpt=ckpts[name], ws=ws, dtype=dtype)[0]
            assert rep["buckets"] >= 1 and rep["bytes_sent"] > 0


def test_verl_sequence_with_lazy_checkpoint(group: RankGroup, ckpts) -> None:
    # Rank 0 passes a streamload.Checkpoint instead of a materialised state dict.
    group.run(cases.case_verl_sequence, ckpt=ckpts["moe"], ws=3, dtype=torch.float32, use_checkpoint=True)


def test_receivers_allocate_only_shards_plus_one_bucket(group: RankGroup, ckpts) -> None:
    bucket = 4 * MiB
    res = group.run(cases.case_receiver_memory, ckpt=ckpts["big"], ws=3, bucket_bytes=bucket)
    for r in res[1:]:
        # Shards + one receive buffer (+ a fixed 24 MiB for allocator, gloo and Python slack),
        # far below the full model that a broadcast receiver would allocate.
        assert r["growth"] <= r["shards"] + bucket + 24 * MiB, r
        assert r["model"] > r["shards"] + bucket + 24 * MiB, r
