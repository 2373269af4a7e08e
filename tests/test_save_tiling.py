"""Exact tiling (streamload/save/tiling.py): every byte of a save is written by one rank from
one value. Ranks whose meshes hold copies of one shard that DTensor does not call replicas
(one mesh per rank, FSDP over mesh['dp'] of a larger mesh) write equal copies once and refuse
copies that differ; ranks whose regions partly overlap are refused. Three gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path

import cases_save_tiling as cases
import pytest
import torch
from rank_group import RankGroup
from safetensors.torch import load_file

WORLD = 3


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


def _leftovers(parent: Path) -> list[str]:
    return [n for n in os.listdir(parent) if ".streamload-" in n]


def test_copies_that_differ_are_refused_on_every_rank(group: RankGroup, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = group.run(cases.case_meshes, out=str(out), layout="own", differ=True)
    assert all("refusing to write a mix" in r.get("error", "") for r in res), res
    assert {r["tensor"] for r in res} == {"b"}, res  # the first region in key order
    assert {r["rank"] for r in res} == {1}  # rank 1 holds other values than rank 0
    assert not out.exists() and not _leftovers(tmp_path)


def test_equal_copies_are_written_once(group: RankGroup, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = group.run(cases.case_meshes, out=str(out), layout="own", differ=False)
    assert all("error" not in r for r in res), res
    got = load_file(out / "model.safetensors")
    assert got.keys() == res[0]["ref"].keys() and all(torch.equal(got[k], res[0]["ref"][k]) for k in got)
    # rank 0 writes the tensors (and the header), the copies on ranks 1 and 2 nothing.
    data = sum(t.numel() * t.element_size() for t in got.values())
    assert res[0]["bytes"] > data and [r["bytes"] for r in res[1:]] == [0, 0], res
    assert not _leftovers(tmp_path)


def test_regions_that_partly_overlap_are_refused(group: RankGroup, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = group.run(cases.case_meshes, out=str(out), layout="split", differ=False)
    assert all("both write elements" in r.get("error", "") for r in res), res
    assert all("ranks [0] and [2]" in r["error"] or "ranks [1] and [2]" in r["error"] for r in res), res
    assert not out.exists() and not _leftovers(tmp_path)


def test_copies_compare_by_the_bytes_written(group: RankGroup, tmp_path: Path) -> None:
    """Copies held in different dtypes compare as the writer casts them: float32 on rank 0 and
    the same values in bfloat16 elsewhere, saved as bfloat16, are equal copies (written once);
    a copy rounded to bfloat16, saved as float16 beside float16 copies, holds other values.
    (Before: compared in each rank's own dtype, the first was refused.)"""
    same = group.run(
        cases.case_meshes, out=str(tmp_path / "a"), layout="own", differ=False,
        dtypes=("float32", "bfloat16", "bfloat16"), save_dtype="bfloat16",
    )  # fmt: skip
    assert all("error" not in r for r in same), same
    got = load_file(tmp_path / "a" / "model.safetensors")
    assert all(torch.equal(got[k], same[0]["ref"][k].to(torch.bfloat16)) for k in got)
    other = group.run(
        cases.case_meshes, out=str(tmp_path / "b"), layout="own", differ=False,
        dtypes=("float16", "float16", "bfloat16"), save_dtype="float16",
    )  # fmt: skip
    assert all("refusing to write a mix" in r.get("error", "") for r in other), other
    assert {r["rank"] for r in other} == {2}


def test_a_rank_failing_to_hash_its_copies_is_one_error_everywhere(group: RankGroup, tmp_path: Path) -> None:
    """The copies' digest fails on rank 1 (out of memory, say): every rank raises a SaveError
    naming it, nothing is written. (Before: rank 1 left the gather the others were in.)"""
    out = tmp_path / "out"
    res = group.run(cases.case_meshes, out=str(out), layout="own", differ=False, digest_fails=1)
    assert all("injected while hashing" in r.get("error", "") for r in res), res
    assert {r["rank"] for r in res} == {1}
    assert not out.exists() and not _leftovers(tmp_path)
