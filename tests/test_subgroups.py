"""Node mode and ``auto`` over subgroups, permuted meshes and replaced files, on four gloo ranks:
a load over part of the world leaves no rank behind in torch's group naming (the next world-wide
``new_group`` works), sibling subgroups load at once, plans follow group ranks, and a file
replaced while the ranks decide never gives a load that mixes two versions."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import cases_subgroups as cases
import pytest
import torch
from rank_group import RankGroup
from small_shapes import SMALL_DENSE

from streamload.tools.synthetic import make_checkpoint

WORLD = 4
TIMEOUT = 120.0  # per case: a hang (e.g. a world-wide new_group some rank never enters) fails


class Ranks:
    """The module's rank group, started again if a case killed it (a hang), so one
    regression fails its own test and not every test after it."""

    def __init__(self) -> None:
        self.group: RankGroup | None = None

    def run(self, fn, **kwargs):  # type: ignore[no-untyped-def]
        if self.group is None or not all(p.is_alive() for p in self.group.procs):
            if self.group is not None:
                self.group.close(kill=True)
            cases._GROUPS.clear()
            self.group = RankGroup(WORLD)
        return self.group.run(fn, timeout=TIMEOUT, **kwargs)


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    r = Ranks()
    yield r
    if r.group is not None:
        r.group.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint(tmp_path_factory.mktemp("sub") / "dense", "qwen2", seed=7, **SMALL_DENSE))


@pytest.mark.parametrize(
    "member_sets, nodes",
    [
        ([[0, 1, 2]], 2),  # one stage of three ranks on two nodes; rank 3 takes no part
        ([[1, 2, 3]], 2),
        ([[1, 3]], 2),  # a dp column of a 2x2 mesh
        ([[0, 1], [2, 3]], 1),  # two stages loading at once, each on one node
        ([[0, 1], [2, 3]], 2),  # ... each on two nodes of one rank
        ([[0, 2], [1, 3]], 2),
        ([[0, 1, 2], [3]], 2),  # a stage of three beside a stage of one
    ],
)
def test_node_load_over_subgroups_leaves_the_world_in_step(
    ranks: Ranks, ckpt: str, member_sets: list[list[int]], nodes: int
) -> None:
    res = ranks.run(cases.case_node_loads_over_subgroups, ckpt=ckpt, member_sets=member_sets, nodes=nodes)
    assert len(set(res[0]["counters"])) == 1
    for members in member_sets:
        reps = [res[r]["reports"][0] for r in members]
        if len(members) > 1 and nodes > 1:
            assert all(r["reader"].startswith("node") and "nodes" in r["reader"] for r in reps), reps[0][
                "reader"
            ]


def test_same_subgroup_loads_twice_in_node_mode(ranks: Ranks, ckpt: str) -> None:
    res = ranks.run(cases.case_node_loads_over_subgroups, ckpt=ckpt, member_sets=[[0, 1, 2]], loads=2)
    assert [len(res[r]["reports"]) for r in (0, 1, 2)] == [2, 2, 2]
    # And the world-wide group after it works for every rank, the one outside the stage included.
    res = ranks.run(cases.case_node_loads_over_subgroups, ckpt=ckpt, member_sets=[[2, 3], [0, 1]], loads=2)
    assert all(len(r["reports"]) == 2 for r in res)


def test_auto_over_a_subgroup_picks_node_and_leaves_the_world_in_step(ranks: Ranks, ckpt: str) -> None:
    res = ranks.run(
        cases.case_node_loads_over_subgroups, ckpt=ckpt, member_sets=[[1, 2, 3]], nodes=2, readers="auto"
    )
    assert all(res[r]["reports"][0]["reader"].startswith("node") for r in (1, 2, 3))


@pytest.mark.parametrize(
    "mesh_ranks, dims, unsorted",
    [
        ([3, 1, 2, 0], ("dp",), True),  # group rank order is not global rank order
        ([1, 3, 0, 2], ("dp",), True),
        ([2, 0, 1], ("dp",), True),  # over part of the world: rank 3 takes no part
        ([0, 3, 1, 2], ("dp",), True),  # nodes {0, 1} and {2, 3} interleave in this order
    ],
)
def test_node_load_on_a_group_in_permuted_rank_order_is_bit_exact(
    ranks: Ranks, ckpt: str, mesh_ranks: list, dims: tuple[str, ...], unsorted: bool
) -> None:
    res = ranks.run(
        cases.case_node_load_on_permuted_mesh,
        ckpt=ckpt,
        mesh_ranks=mesh_ranks,
        dims=dims,
        unsorted_group=unsorted,
    )
    members = [r for r in range(WORLD) if res[r]["reports"] or res[r]["error"]]
    assert res[members[0]]["group_ranks"] == torch.tensor(mesh_ranks).flatten().tolist()
    for r in members:
        assert res[r]["error"] is None, res[r]["error"]
        # Each node's reader reads; the other rank of its node receives its shards over the wire.
        assert "2 nodes" in res[r]["reports"][0]["reader"], res[r]["reports"][0]["reader"]


@pytest.mark.parametrize(
    "mesh_ranks, dims",
    [
        ([3, 1, 2, 0], ("dp",)),
        ([[3, 1], [2, 0]], ("dp", "tp")),  # the dp columns [3, 2] and [1, 0], loading at once
        ([[0, 1], [2, 3]], ("dp", "tp")),  # in order: dp columns [0, 2] and [1, 3] load
    ],
)
def test_node_load_on_a_permuted_device_mesh_loads_or_refuses_everywhere(
    ranks: Ranks, ckpt: str, mesh_ranks: list, dims: tuple[str, ...]
) -> None:
    res = ranks.run(cases.case_node_load_on_permuted_mesh, ckpt=ckpt, mesh_ranks=mesh_ranks, dims=dims)
    for r in res:
        if r["ordered"]:
            assert r["error"] is None and r["reports"], r["error"]
        else:  # fully_shard's shards contradict DTensor's placements: refused, by name, on every rank
            assert r["error"] is not None and "layout semantics" in r["error"], r["error"]


@pytest.mark.parametrize(
    "when, nodes",
    [(w, nodes) for w in ("never", "before_choice", "after_choice") for nodes in (False, True)],
)
def test_auto_never_mixes_files_replaced_while_it_decides(
    ranks: Ranks, ckpt: str, tmp_path: Path, when: str, nodes: bool
) -> None:
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    new = tmp_path / "new"
    shutil.copytree(ckpt, new)
    cases.replace_shard(str(new))
    live = tmp_path / "live"
    shutil.copytree(ckpt, live)
    res = ranks.run(
        cases.case_files_replaced_while_choosing,
        ckpt=str(live),
        old=str(old),
        new=str(new),
        when=when,
        nodes=nodes,
    )
    assert all(r["version"] == "old" for r in res), res
    if when == "never":  # the same files throughout: owners over one shared copy, or node
        assert all(r["reader"].startswith("node" if nodes else "owners") for r in res), res[0]["reader"]
        return
    # Rank 0 had opened the old files: only it reads, so the load is the old version throughout.
    assert all(r["reader"].startswith("src") for r in res), res[0]["reader"]
    assert "changed" in res[0]["reader"] or "copies" in res[0]["reader"], res[0]["reader"]


def test_opened_identity_is_what_the_descriptors_read(ckpt: str, tmp_path: Path) -> None:
    from streamload.io.checkpoint import Checkpoint
    from streamload.transport.readers import ReaderChoice, ReaderMode, file_identity, opened_identity

    live = tmp_path / "live"
    shutil.copytree(ckpt, live)
    held = Checkpoint(live)
    before = opened_identity(held)
    assert before is not None and before == file_identity(live)
    choice = ReaderChoice(ReaderMode.OWNERS, "test", proof=before)
    assert choice.proof_holds(held) and choice.proof_holds(Checkpoint(live))
    cases.replace_shard(str(live))
    # The path names the new file now; the open checkpoint still reads the old one.
    assert opened_identity(held) == before != file_identity(live)
    fresh = Checkpoint(live)
    assert opened_identity(fresh) == file_identity(live)
    assert choice.proof_holds(held) and not choice.proof_holds(fresh)
    assert ReaderChoice(ReaderMode.SRC, "no proof").proof_holds(fresh)
    assert opened_identity({"w": torch.zeros(1)}) is None


def test_transport_rows_must_be_ascending_group_ranks() -> None:
    from streamload.transport.collectives import Transport

    cpu = torch.device("cpu")
    assert Transport(None, 0, cpu).rows == [0]
    for rows in ([1], [0, 0], [-1]):
        with pytest.raises(ValueError, match="ascending"):
            Transport(None, 0, cpu, rows)


@pytest.mark.parametrize(
    "members, failing, readers", [([1, 2, 3], 3, "src"), ([1, 2, 3], 3, "owners"), ([0, 2, 3], 3, "node")]
)
def test_a_failure_in_a_subgroup_load_names_the_global_rank(
    ranks: Ranks, ckpt: str, members: list[int], failing: int, readers: str
) -> None:
    res = ranks.run(
        cases.case_failure_names_the_global_rank, ckpt=ckpt, members=members, failing=failing, readers=readers
    )
    for r in members:
        assert res[r]["raised"] is not None, r
        if r == failing:  # the failing rank raises its own error
            assert res[r]["raised"][0] == "RuntimeError" and "injected" in res[r]["raised"][2], res[r][
                "raised"
            ]
        else:  # the others name it by its global rank, as errors before the stream do
            assert res[r]["raised"][1] == failing, (r, res[r]["raised"])
