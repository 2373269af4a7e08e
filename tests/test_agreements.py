"""Steps that ran on one rank outside an agreement: each now raises the same named error on
every rank within seconds (or cannot fail there, or fails harmlessly). 3 gloo ranks; a case
that hangs fails at the RankGroup's deadline instead of waiting for the group's timeout."""

from __future__ import annotations

import json
import os
import shutil

import cases_agreements as cases
import pytest
from rank_group import RankGroup
from small_shapes import SMALL_DENSE

from streamload.tools.synthetic import make_checkpoint

WORLD = 3
DEADLINE = 60.0  # per case: a hang fails here (the gloo group's own timeout is 30 minutes)


@pytest.fixture(scope="module")
def group3():
    g = RankGroup(WORLD)
    yield g
    g.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(
        make_checkpoint(tmp_path_factory.mktemp("agree") / "ckpt", "qwen2", tie=True, seed=5, **SMALL_DENSE)
    )


@pytest.mark.parametrize("entry", ["verl", "areal", "accelerate", "load_checkpoint"])
def test_sharded_full_state_is_a_named_error_on_every_rank(group3: RankGroup, ckpt: str, entry: str) -> None:
    """A DTensor state dict as the full state: the reader would call full_tensor(), a
    collective, alone. Every rank raises CheckpointError naming a key and the fix."""
    out = group3.run(cases.case_sharded_full_state, timeout=DEADLINE, ckpt=ckpt, entry=entry)
    for row in out:
        assert row["raised"] == "CheckpointError", row
        assert row["tensor"] in row["keys"], row
        assert "full_state_dict=True" in row["message"] and "load_checkpoint" in row["message"], row
        assert row["seconds"] < 30, row


@pytest.fixture(scope="module")
def ckpt_with_fifo(tmp_path_factory: pytest.TempPathFactory, ckpt: str) -> str:
    d = tmp_path_factory.mktemp("fifo") / "ckpt"
    shutil.copytree(ckpt, d)
    assert (d / "model.safetensors.index.json").exists()
    os.mkfifo(d / "x.safetensors")  # not in the index: the loader never reads it
    return str(d)


def test_fifo_named_safetensors_does_not_block_the_reader_choice(
    group3: RankGroup, ckpt: str, ckpt_with_fifo: str
) -> None:
    """Choosing the readers opened every ``*.safetensors`` of the directory: a FIFO blocked
    every rank at open(). Only regular files are described; the load is the plain one's."""
    out = group3.run(
        cases.case_load_beside_special_files, timeout=DEADLINE, ckpt=ckpt_with_fifo, nul_rank=None
    )
    ref = group3.run(cases.case_load_beside_special_files, timeout=DEADLINE, ckpt=ckpt, nul_rank=None)
    assert [o["sums"] for o in out] == [r["sums"] for r in ref]
    assert all(o["reader"].startswith("owners") for o in out), out  # every rank sees the same files


def test_nul_byte_in_a_receivers_path_does_not_hang(group3: RankGroup, ckpt: str) -> None:
    """A receiver's path with a NUL byte raised ValueError in the reader choice, outside the
    all-gather: the others waited there. It is a rank that does not see the checkpoint."""
    out = group3.run(cases.case_load_beside_special_files, timeout=DEADLINE, ckpt=ckpt, nul_rank=2)
    ref = group3.run(cases.case_load_beside_special_files, timeout=DEADLINE, ckpt=ckpt, nul_rank=None)
    assert [o["sums"] for o in out] == [r["sums"] for r in ref]
    assert all(o["reader"].startswith("src") for o in out), out


def test_eviction_failure_is_a_warning_not_a_one_rank_error(group3: RankGroup, ckpt: str) -> None:
    """drop_cache's eviction runs after the last agreement: it failing on one rank raised
    there alone (the others returned a loaded model). It is advisory: logged, the load stands."""
    out = group3.run(cases.case_eviction_fails_on_one_rank, timeout=DEADLINE, ckpt=ckpt, failing=1)
    assert [o["read_mode"] for o in out] == ["mmap"] * WORLD, json.dumps(out)
    assert [bool(o["warned"]) for o in out] == [False, True, False], out
