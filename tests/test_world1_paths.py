"""``STREAMLOAD_FORCE_MULTI_RANK`` on one gloo rank: the paths a one-GPU device check takes
(tests/test_gpu.py runs the same ``cases_world1.run_world1`` on one NCCL rank). Every load
and save goes through the collectives, counted, and stays bit-exact."""

from __future__ import annotations

from typing import Any

import cases_world1 as cases
import pytest
from rank_group import RankGroup

from streamload.options import force_multi_rank
from streamload.tools.synthetic import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("world1")
    return str(
        make_checkpoint(root / "moe", "qwen3_moe", tie=True, seed=3, num_experts=5, max_shard_size="30KB")
    )


@pytest.fixture(scope="module")
def group() -> Any:
    g = RankGroup(1)
    yield g
    g.close()


def test_a_group_of_one_takes_the_multi_rank_paths_when_forced(group: RankGroup, ckpt: str) -> None:
    res = group.run(cases.case_world1, ckpt=ckpt, force=True)[0]
    for mode in ("src", "node"):
        calls = res[f"load:{mode}"]
        # The transport (one all_to_all per bucket, its status flag), the metadata broadcast and
        # the hand-rolled object gather of every agreement.
        assert calls.get("all_to_all_single", 0) > 3 and calls.get("all_reduce", 0) > 3, (mode, calls)
        assert calls.get("broadcast", 0) >= 2 and calls.get("all_gather", 0) >= 4, (mode, calls)
    assert res["load:owners"].get("all_reduce", 0) >= 1 and res["load:owners"].get("all_gather", 0) >= 4, res
    assert [r.split(":")[0] for r in res["reader"]] == ["src", "owners", "node"], res["reader"]
    assert res["save:src"].get("all_to_all_single", 0) > 0, res  # the src writer's exchange
    assert res["save:owners"].get("all_gather", 0) >= 4, res  # the tiling check and the agreements
    # On gloo the flags ride the group itself: no side group (on NCCL one gloo group per call).
    assert not any(
        k.startswith("new_group") for step in res.values() if isinstance(step, dict) for k in step
    ), res


def test_without_the_switch_a_group_of_one_calls_no_collective(group: RankGroup, ckpt: str) -> None:
    res = group.run(cases.case_world1, ckpt=ckpt, force=False)[0]
    steps = {k: v for k, v in res.items() if k != "reader"}
    assert all(not calls for calls in steps.values()), steps
    assert [r.split(":")[0] for r in res["reader"]] == ["src", "owners", "src"], res["reader"]


def test_the_switch_is_read_once_and_refuses_typos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMLOAD_FORCE_MULTI_RANK", "yes")
    force_multi_rank.cache_clear()
    try:
        assert force_multi_rank()
        monkeypatch.setenv("STREAMLOAD_FORCE_MULTI_RANK", "0")
        assert force_multi_rank()  # read once: a later change is not seen
        force_multi_rank.cache_clear()
        assert not force_multi_rank()
        monkeypatch.setenv("STREAMLOAD_FORCE_MULTI_RANK", "sure")
        force_multi_rank.cache_clear()
        with pytest.raises(ValueError, match="STREAMLOAD_FORCE_MULTI_RANK"):
            force_multi_rank()
    finally:
        monkeypatch.delenv("STREAMLOAD_FORCE_MULTI_RANK")
        force_multi_rank.cache_clear()
