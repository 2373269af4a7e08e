"""accelerate's own FSDP2 flow (``FullyShardedDataParallelPlugin(fsdp_version=2,
cpu_ram_efficient_loading=True)`` + ``Accelerator.prepare``) with its single load call
site patched to streamload's accelerate entry, on 2 CPU ranks, bit for bit against
transformers' ``from_pretrained``, ties held."""

from __future__ import annotations

import cases_clients as cases
import pytest
import torch
from rank_group import RankGroup
from small_shapes import SMALL_DENSE

from streamload.tools.synthetic import make_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("accelerate")
    common = SMALL_DENSE
    return {
        "tied": str(make_checkpoint(root / "tied", "qwen2", tie=True, seed=41, **common)),
        "untied": str(make_checkpoint(root / "untied", "qwen2", tie=False, seed=42, **common)),
    }


@pytest.fixture(scope="module")
def group():
    g = RankGroup(2)
    yield g
    g.close()


def _check(group: RankGroup, ckpt: str, dtype: torch.dtype, tie: bool) -> None:
    for use_streamload in (False, True):
        res = group.run(cases.case_accelerate, ckpt=ckpt, use_streamload=use_streamload, dtype=dtype)
        for r in res:
            assert r["sharded"] > 0, r  # accelerate really sharded the model
            assert r["streamload_calls"] == int(use_streamload), r
            assert r["bad"] == [] and r["tied"] is tie and r["ref_tied"] is tie, (use_streamload, r)


def test_accelerate_prepare_tied(group: RankGroup, ckpts: dict[str, str]) -> None:
    _check(group, ckpts["tied"], torch.bfloat16, True)


@pytest.mark.slow
def test_accelerate_prepare_untied_fp32(group: RankGroup, ckpts: dict[str, str]) -> None:
    _check(group, ckpts["untied"], torch.float32, False)


@pytest.mark.slow
def test_accelerate_prepare_tied_4_ranks(ckpts: dict[str, str]) -> None:
    """4 ranks (uneven vocab shards): accelerate's own flow and the patched one, both bit-exact."""
    group4 = RankGroup(4)
    try:
        _check(group4, ckpts["tied"], torch.bfloat16, True)
    finally:
        group4.close()
