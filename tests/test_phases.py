"""LoadReport.phases cover the whole load: the top-level phases add up to its wall time."""

from __future__ import annotations

import time

import pytest
import torch
from cases_phases import case_copy_threads, case_phases, case_residency_checks
from rank_group import RankGroup

import streamload
from streamload.integrations.pretrained import meta_model
from streamload.io.copy_ops import worker_threads
from streamload.timeline import PhaseClock, top_level
from streamload.tools.synthetic import make_checkpoint

# Phases every from_pretrained reports, in the order they run (agreements included).
PRETRAINED = ["meet", "setup", "open", "build", "shard", "agree_build", "state", "readers", "match", "materialize"]
LOAD = ["layout", "agree_layout", "plan", "map", "strategy_open", "agree_plan", "stream", "close"]
END = ["ties", "agree_final", "finalize"]


def _close_to_wall(top: dict[str, float], seconds: float, wall: float) -> None:
    """The phases add up to the report's seconds, and those to the wall time seen from outside
    (within 3 %, and a few milliseconds for the call itself on a tiny checkpoint)."""
    total = sum(top.values())
    assert total == pytest.approx(seconds, rel=1e-9, abs=1e-9)
    assert abs(wall - total) <= 0.03 * wall + 0.005, (wall, total, top)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("phases")
    return str(
        make_checkpoint(
            root / "qwen2",
            "qwen2",
            tie=True,
            seed=3,
            layers=2,
            vocab=61,
            hidden_size=24,
            intermediate_size=38,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_shard_size="8KB",
        )
    )


def test_clock_parts_are_not_counted_twice() -> None:
    clock = PhaseClock()
    with clock.part("open.config"):
        pass
    clock.mark("open")
    clock.mark("match")
    assert set(top_level(clock.phases)) == {"open", "match"}
    assert sum(top_level(clock.phases).values()) == pytest.approx(clock.total())
    assert clock.phases["open.config"] <= clock.phases["open"]


def test_from_pretrained_phases_add_up(ckpt: str) -> None:
    t0 = time.perf_counter()
    model = streamload.from_pretrained(ckpt, dtype=torch.float32, progress=False)
    wall = time.perf_counter() - t0
    rep = model.streamload_report
    top = top_level(rep.phases)
    assert list(top) == [p for p in [*PRETRAINED, *LOAD, *END] if p in top]
    assert set(PRETRAINED + ["stream", "ties", "finalize"]) <= set(top)
    assert {"open.files", "open.config", "open.broadcast"} <= set(rep.phases)
    _close_to_wall(top, rep.seconds, wall)


def test_load_checkpoint_phases_add_up(ckpt: str) -> None:
    model = meta_model(ckpt, torch.float32)
    t0 = time.perf_counter()
    rep = streamload.load_checkpoint(model, ckpt, progress=False)
    wall = time.perf_counter() - t0
    top = top_level(rep.phases)
    assert "build" not in top and {"open", "match", "materialize", "stream", "finalize"} <= set(top)
    assert any(k.startswith("stream.") for k in rep.phases)
    _close_to_wall(top, rep.seconds, wall)


@pytest.fixture(scope="module")
def group():
    g = RankGroup(2)
    yield g
    g.close()


@pytest.mark.parametrize("readers", ["auto", "src"])
def test_phases_add_up_on_every_rank(group: RankGroup, ckpt: str, readers: str) -> None:
    res = group.run(case_phases, ckpt=ckpt, readers=readers)
    for r in res:
        assert {"readers", "agree_layout", "agree_plan", "agree_final"} <= set(r["top"])
        if readers == "auto":
            assert "open_own" in r["top"] or r is res[0]  # ranks but the first open their own files
        _close_to_wall(r["top"], r["seconds"], r["wall"])


def test_ranks_on_the_readers_host_reuse_its_residency_check(group: RankGroup, ckpt: str) -> None:
    # The reader measured the files' page-cache residency; the others read the very same files.
    assert group.run(case_residency_checks, ckpt=ckpt) == [1, 0]


def test_ranks_of_a_node_copy_with_equal_shares_of_its_cores(group: RankGroup, ckpt: str) -> None:
    # The reader opened its files with every core's threads before the choice; in owners mode it
    # takes its share (a new engine over the files it holds open, no second open), as the others
    # open theirs with theirs: no rank is left behind on fewer.
    share = max(1, worker_threads() // 2)
    assert group.run(case_copy_threads, ckpt=ckpt) == [
        {"opened": [], "moved": [share]},
        {"opened": [share], "moved": []},
    ]
