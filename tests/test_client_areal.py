"""AReaL 1.0.4's own load path (FSDPEngine's model build, ``parallelize_model``,
``fsdp2_load_full_state_dict``) against streamload's AReaL entry swapped in, on 2 and 4
CPU ranks, bit for bit against transformers' ``from_pretrained``."""

from __future__ import annotations

import importlib.util

import cases_clients as cases
import pytest
from rank_group import RankGroup
from small_shapes import SMALL_DENSE

from streamload.tools.synthetic import make_checkpoint

# Only the rank processes import AReaL: importing it reconfigures logging process-wide (the
# "streamload" logger's records stop reaching pytest's caplog in later test modules).
if importlib.util.find_spec("areal") is None:
    pytest.skip("AReaL: pip install --no-deps -r .ci/clients-nodeps.txt", allow_module_level=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("areal")
    return {
        "dense": str(make_checkpoint(root / "dense", "qwen2", tie=True, seed=31, **SMALL_DENSE)),
        # transformers 5's save_pretrained writes qwen3_moe one tensor per expert.
        "moe": str(
            make_checkpoint(
                root / "moe", "qwen3_moe", tie=True, seed=32, num_experts=5, max_shard_size="30KB"
            )
        ),
    }


def _check_moe(group: RankGroup, ckpt: str) -> None:
    own = group.run(cases.case_areal, ckpt=ckpt, loader="areal")
    for r in own:
        # AReaL's rank-0 load_state_dict(strict=False) never fuses the per-expert tensors:
        # exactly the fused experts keep their random init; everything else is right.
        assert r["fused"] and set(r["bad"]) == set(r["fused"]), r
    swapped = group.run(cases.case_areal, ckpt=ckpt, loader="streamload_dict")
    for r in swapped:
        # The same wrong state dict gives the same wrong experts: the bug is upstream of the call.
        assert set(r["bad"]) == set(r["fused"]), r
    for loader in ("streamload_path", "streamload_lazy"):
        for r in group.run(cases.case_areal, ckpt=ckpt, loader=loader):
            assert r["bad"] == [] and r["tied"] is True and r["ref_tied"] is True, (loader, r)


def _check_dense(group: RankGroup, ckpt: str) -> None:
    for loader in ("areal", "streamload_dict", "streamload_path", "streamload_lazy"):
        for r in group.run(cases.case_areal, ckpt=ckpt, loader=loader):
            assert r["bad"] == [] and r["tied"] is True and r["ref_tied"] is True, (loader, r)


def test_areal_moe_per_expert_2_ranks(group2: RankGroup, ckpts: dict[str, str]) -> None:
    _check_moe(group2, ckpts["moe"])


@pytest.mark.slow
def test_areal_dense_tied_2_ranks(group2: RankGroup, ckpts: dict[str, str]) -> None:
    _check_dense(group2, ckpts["dense"])


@pytest.mark.slow
def test_areal_tie_flag_disagreeing_is_tie_error_everywhere(group2: RankGroup, ckpts: dict[str, str]) -> None:
    assert group2.run(cases.case_areal_tie_flag, ckpt=ckpts["dense"], timeout=120) == ["TieError"] * 2


@pytest.mark.slow
def test_areal_dense_tied_4_ranks(group4: RankGroup, ckpts: dict[str, str]) -> None:
    _check_dense(group4, ckpts["dense"])


@pytest.mark.slow
def test_areal_moe_per_expert_4_ranks(group4: RankGroup, ckpts: dict[str, str]) -> None:
    _check_moe(group4, ckpts["moe"])
