"""Recipes that give rank 0 a checkpoint: a path or ``Checkpoint.lazy(path)`` opens
inside streamload's agreement, so a missing or corrupt checkpoint is the same named
error on every rank (never rank 0 alone while the others wait)."""

from __future__ import annotations

import os
from pathlib import Path

import cases_clients as cases
import pytest
from rank_group import RankGroup

import streamload
from streamload.tools.synthetic import make_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lazy")
    good = make_checkpoint(root / "good", "qwen2", tie=True, seed=61, layers=1, vocab=64)
    bad = make_checkpoint(root / "bad", "qwen2", tie=True, seed=61, layers=1, vocab=64)
    shard = next(bad.glob("*.safetensors"))
    os.truncate(shard, 8 + 10)  # the header now claims more than the file holds
    return {"good": str(good), "corrupt": str(bad), "missing": str(root / "nothing")}


@pytest.fixture(scope="module")
def group():
    g = RankGroup(2)
    yield g
    g.close()


def test_lazy_opens_nothing_until_loaded(ckpts: dict[str, str]) -> None:
    lazy = streamload.Checkpoint.lazy(ckpts["missing"])  # no error here: nothing is opened
    assert os.fspath(lazy) == ckpts["missing"] and isinstance(lazy, os.PathLike)
    opened = streamload.Checkpoint.lazy(ckpts["good"], mode="pread").open(mode="mmap")
    assert opened.read_mode == "pread" and Path(opened.path) == Path(ckpts["good"])


@pytest.mark.parametrize("recipe", ["path", "lazy"])
@pytest.mark.parametrize(("which", "error"), [("missing", "CheckpointError"), ("corrupt", "HeaderError")])
def test_bad_checkpoint_is_a_named_error_on_every_rank(
    group: RankGroup, ckpts: dict[str, str], recipe: str, which: str, error: str
) -> None:
    assert group.run(cases.case_lazy_error, ckpt=ckpts[which], recipe=recipe, timeout=120) == [error] * 2


def test_lazy_loads_bit_exact(group: RankGroup, ckpts: dict[str, str]) -> None:
    for r in group.run(cases.case_load_path, ckpt=ckpts["good"], lazy=True, timeout=120):
        assert r["bad"] == [] and r["tied"] is True, r
