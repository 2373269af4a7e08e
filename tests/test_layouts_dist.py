"""Every 2-D layout on a 2x2 mesh of 4 gloo ranks: torch's own local shards
reproduced by the pure box computation, loads bit-exact in every reader mode,
and Partial / unknown placements refused by name on every rank."""

from __future__ import annotations

import cases_layouts as cases
import pytest
import torch
from rank_group import RankGroup
from safetensors.torch import save_file

WORLD = 4


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


@pytest.fixture(scope="module")
def grid_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("grid")
    save_file(cases.grid_state(cases.grid_shapes(), seed=5), str(root / "model.safetensors"))
    return str(root)


def test_boxes_match_distribute_tensor(group: RankGroup) -> None:
    res = group.run(cases.case_boxes_match_torch, timeout=120)
    n = len(cases.combos()) * len(cases.SHAPES)
    assert all(r["checked"] == n for r in res)
    # The combinations do produce several boxes per rank somewhere (the case the plan must carry).
    assert sum(r["multi_box"] for r in res) > 0


@pytest.mark.parametrize("readers", ["src", "owners", "node"])
def test_every_2d_layout_loads_exactly(group: RankGroup, grid_ckpt: str, readers: str) -> None:
    res = group.run(cases.case_load_grid, timeout=120, ckpt=grid_ckpt, readers=readers, dtype=torch.float32)
    assert {r["mode"] for r in res} == {readers}
    assert res[0]["buckets"] > 1 or readers == "owners"  # owners on CPU: one coarse bucket


def test_every_2d_layout_loads_exactly_bf16(group: RankGroup, grid_ckpt: str) -> None:
    group.run(cases.case_load_grid, timeout=120, ckpt=grid_ckpt, readers="src", dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", ["partial", "unknown"])
def test_partial_and_unknown_raise_on_every_rank(group: RankGroup, grid_ckpt: str, kind: str) -> None:
    msgs = group.run(cases.case_refused, timeout=60, ckpt=grid_ckpt, kind=kind)
    assert len(msgs) == WORLD
    for m in msgs:
        assert "params.1" in m
        assert ("Partial" in m) if kind == "partial" else ("unknown placement type" in m)


def test_specs_that_differ_between_ranks_raise_everywhere(group: RankGroup, grid_ckpt: str) -> None:
    msgs = group.run(cases.case_specs_differ, timeout=60, ckpt=grid_ckpt)
    assert all("differ between ranks" in m and "[3]" in m for m in msgs), msgs
