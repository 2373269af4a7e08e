"""No rank left waiting: a rank that never calls, ranks whose options differ, a Ctrl-C inside an
agreement, a rank killed mid-call, a pipeline stage saving alone. Each of these hung (or ended in
a raw gloo error, or aborted a process) before ``transport/arrival.py``."""

from __future__ import annotations

import queue

import cases_arrival as cases
import pytest
from rank_group import RankGroup
from small_shapes import SMALL_DENSE

from streamload.tools.synthetic import make_checkpoint
from streamload.transport.arrival import DEFAULT_TIMEOUT, resolve_timeout

SHORT = 3.0  # the test's deadline (docs/options.md: the default is DEFAULT_TIMEOUT)
ENTRIES = ["from_pretrained", "load_checkpoint", "fsdp2_load_full_state_dict", "save_pretrained"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint(tmp_path_factory.mktemp("arr") / "ckpt", "qwen2", tie=True, seed=3, **SMALL_DENSE))


@pytest.fixture(scope="module", params=[2, 3])
def group(request: pytest.FixtureRequest, ckpt: str):
    g = RankGroup(request.param)
    g.run(cases.case_prepare, ckpt=ckpt)
    yield g
    g.close()


def test_timeout_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMLOAD_TIMEOUT", raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT == 300.0
    monkeypatch.setenv("STREAMLOAD_TIMEOUT", "12.5")
    assert resolve_timeout(None) == 12.5
    assert resolve_timeout(4) == 4.0  # the keyword wins
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("STREAMLOAD_TIMEOUT", bad)
        with pytest.raises(ValueError, match="STREAMLOAD_TIMEOUT"):
            resolve_timeout(None)


def test_torch_store_api(group: RankGroup) -> None:
    """The meeting uses torch's private default-store accessor: this fails loudly if it changes."""
    for row in group.run(cases.case_meeting_keys):
        assert row == {"store": "PrefixStore", "ops": True}, row


def test_store_keys_do_not_grow(group: RankGroup, ckpt: str) -> None:
    """Each meeting deletes the one before the last: a sync every training step keeps the store flat."""
    for counts in group.run(cases.case_store_stays_small, ckpt=ckpt):
        # Without the deletes each load adds world + 2 keys; a count read while a peer's deletes
        # are in flight may be a few keys high, never growing.
        assert counts[5] <= counts[2] and max(counts[2:]) < counts[2] + group.world + 3, counts


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("absent", ["last", "first"])
def test_rank_that_never_calls_is_named(group: RankGroup, ckpt: str, tmp_path, entry: str, absent: str) -> None:
    world = group.world
    who = world - 1 if absent == "last" else 0
    out_dir = str(tmp_path / "out")
    rows = group.run(
        cases.case_one_rank_never_calls,
        timeout=60,
        ckpt=ckpt,
        entry=entry,
        absent=who,
        deadline=SHORT,
        out_dir=out_dir,
    )
    for r, row in enumerate(rows):
        assert row["raised"] == "RankAbsentError", row
        assert row["ranks"] == [who] and row["step"] == entry, row
        assert f"ranks [{who}]" in row["message"] and entry in row["message"], row
        if r == who:  # its late call met the abandoned meeting: at once, no collective
            assert "arrived after its peers stopped waiting" in row["message"], row
            assert row["seconds"] < SHORT, row
        else:
            assert "did not arrive within" in row["message"] and "hint:" in row["message"], row
            assert SHORT <= row["seconds"] < SHORT + 15, row
        assert row["left_files"] == [], row  # a refused save writes nothing, not even a temp dir


@pytest.mark.parametrize("option, name", [("readers", "readers="), ("entry", "different entry points"),
                                          ("max_shard_size", "max_shard_size=")])  # fmt: skip
def test_options_that_differ_are_named(group: RankGroup, ckpt: str, option: str, name: str) -> None:
    for row in group.run(cases.case_options_differ, timeout=60, ckpt=ckpt, option=option):
        assert row["raised"] == "OptionMismatchError", row
        assert name in row["message"] and "on ranks" in row["message"], row
        assert row["seconds"] < 15, row


def test_submesh_of_one_stage_leaves_world_groups_in_step(ckpt: str, tmp_path) -> None:
    g = RankGroup(2)
    try:
        rows = g.run(cases.case_submesh_then_world_group, timeout=90, ckpt=ckpt, out_dir=str(tmp_path / "o"))
    finally:
        g.close(kill=True)
    assert [r["sum"] for r in rows] == [2.0, 2.0], rows
    assert (tmp_path / "o" / "config.json").exists()


def test_interrupt_inside_an_agreement(group: RankGroup, ckpt: str) -> None:
    victim = group.world - 1
    rows = group.run(cases.case_interrupt_between_halves, timeout=90, ckpt=ckpt, victim=victim)
    for r, row in enumerate(rows):
        if r == victim:
            assert row["raised"] == "KeyboardInterrupt", row
            assert row["gathers"] >= 2, row  # the second half ran before the interrupt was raised
        else:
            assert row["raised"] == "RemoteRankError", row
            assert f"rank {victim}" in row["message"] and "interrupted" in row["message"], row


def test_interrupt_during_save_commits_nothing(group: RankGroup, tmp_path) -> None:
    victim = group.world - 1
    rows = group.run(cases.case_interrupt_during_save, timeout=90, out_dir=str(tmp_path / "out"), victim=victim)
    for r, row in enumerate(rows):
        assert row["left"] == [] and row["handler_restored"], row  # nothing committed, no temp dir
        if r == victim:
            assert row["raised"] == "KeyboardInterrupt", row
        else:
            assert row["raised"] == "SaveError" and f"rank {victim}" in row["message"], row


def test_interrupt_during_commit_is_a_made_save(group: RankGroup, tmp_path) -> None:
    rows = group.run(cases.case_interrupt_during_commit, timeout=90, out_dir=str(tmp_path / "out"))
    assert rows[0]["raised"] == "KeyboardInterrupt" and rows[0]["saved"], rows[0]
    assert all(row["raised"] is None and row["saved"] for row in rows[1:]), rows


def _run_partial(g: RankGroup, fn, survivors: list[int], timeout: float, **kwargs) -> dict[int, dict]:
    for q in g.commands:
        q.put((fn.__module__, fn.__name__, kwargs))
    out: dict[int, dict] = {}
    while len(out) < len(survivors):
        try:
            rank, ok, value = g.results.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"survivors {sorted(set(survivors) - set(out))} hang") from None
        assert ok, value
        out[rank] = value
    return out


# Each entry and mode once at 2 or 3 ranks in the default run (about 14 s each); the rest --runslow.
_KILLED = [(w, e, m) for w in (2, 3) for e in ("load_checkpoint", "save_pretrained") for m in ("src", "owners")]
_KILLED_DEFAULT = {(2, "load_checkpoint", "src"), (3, "load_checkpoint", "owners"),
                   (2, "save_pretrained", "owners"), (3, "save_pretrained", "src")}  # fmt: skip


@pytest.mark.parametrize(
    "world, entry, mode",
    [pytest.param(*c, marks=() if c in _KILLED_DEFAULT else pytest.mark.slow, id=f"{c[1]}-{c[2]}-{c[0]}") for c in _KILLED],
)  # fmt: skip
def test_rank_killed_mid_call_is_named(ckpt: str, tmp_path, world: int, entry: str, mode: str) -> None:
    g = RankGroup(world)
    try:
        g.run(cases.case_prepare, ckpt=ckpt)
        out = _run_partial(
            g, cases.case_killed_mid_call, list(range(world - 1)), 90,
            ckpt=ckpt, entry=entry, readers=mode, out_dir=str(tmp_path / "out"),
        )  # fmt: skip
    finally:
        g.close(kill=True)
    lost = world - 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a temporary directory was left"
    for row in out.values():
        want = "RankLostError" if entry == "load_checkpoint" else "SaveError"
        assert row["raised"] == want, row
        assert f"lost ranks [{lost}]" in row["message"] and entry in row["message"], row
        assert row["seconds"] < 60, row
