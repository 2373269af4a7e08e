"""save_pretrained under failure at 3 gloo ranks (FSDP2, uneven shards), with the owners and
the src writer: a failure injected on one rank (its packer mid-stream with buckets in flight,
an ENOSPC from os.pwrite, its plan, a KeyboardInterrupt mid-stream) or a real full file system
is one SaveError naming that rank on every rank, within the case timeout (no hang); the
checkpoint already at the target survives byte for byte, no temporary directory is left, and
the ranks are still in step (a clean save right after succeeds). Also: src over ranks that
each see a different directory (simulated: rank r saves to DIR/r/ckpt) writes the whole
checkpoint on rank 0 only, equal to the owners output."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import cases_save_faults as cases
import pytest
from rank_group import RankGroup

from streamload.save import commit
from streamload.tools.synthetic import make_checkpoint

WORLD = 3
TIMEOUT = 120


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("save_faults")
    dense = dict(vocab=62, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    return str(
        make_checkpoint(root / "llama", "llama", tie=False, seed=5, layers=2, max_shard_size="16KB", **dense)
    )


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _old(target: Path) -> dict[str, bytes]:
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"old weights" * 50)
    (target / "config.json").write_text('{"old": true}')
    return _snapshot(target)


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if commit.TMP_TAG in p.name or commit.OLD_TAG in p.name]


# (where, fail_rank, at, words in the error). pack at its 3rd call: mid-stream, buckets already sent
# (src) or written (owners). pwrite on rank 0: in src the writer of every rank's bytes.
FAULTS = [
    ("pack", 1, 3, "injected pack failure"),
    ("pack", 0, 3, "injected pack failure"),
    ("pwrite", 0, 2, "No space left on device"),
    ("pwrite", 2, 1, "No space left on device"),
    # A write that fails late (src: the write thread, after the next step's collectives started):
    # before, the writer raised between two collectives and every rank hung.
    ("slow_pwrite", 0, 1, "No space left on device"),
    ("plan", 2, 1, "injected plan failure"),
    ("open", 0, 1, "Too many open files"),  # in src the writer alone opens: it must not stream alone
    ("open", 2, 2, "Too many open files"),
    ("interrupt", 1, 3, "KeyboardInterrupt"),
    ("interrupt", 0, 2, "KeyboardInterrupt"),
]


# In src mode only rank 0 calls pwrite and opens the files: such a fault on another rank is no case there.
CASES = [
    (w, *f)
    for w in ("owners", "src")
    for f in FAULTS
    if not (w == "src" and f[0] in ("pwrite", "slow_pwrite", "open") and f[1] != 0)
]


@pytest.mark.parametrize("writers,where,fail_rank,at,words", CASES)
def test_fault_agreed(
    group: RankGroup, ckpt: str, tmp_path: Path, writers: str, where: str, fail_rank: int, at: int, words: str
) -> None:
    target = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
    before = _old(target)
    got = group.run(
        cases.case_fault, timeout=TIMEOUT, ckpt=ckpt, out=str(target), writers=writers, where=where,
        fail_rank=fail_rank, at=at,
    )  # fmt: skip
    others = [g for r, g in enumerate(got) if r != fail_rank]
    if where == "interrupt":
        assert got[fail_rank]["raised"] == "KeyboardInterrupt", got
    else:
        assert got[fail_rank]["raised"] == "SaveError" and got[fail_rank]["rank"] == fail_rank, got
        others.append(got[fail_rank])
    assert all(
        g["raised"] == "SaveError" and g["rank"] == fail_rank and words in g["text"] for g in others
    ), got
    assert len({g["text"] for g in others}) == 1, got  # the same error on every rank
    assert _snapshot(target) == before
    assert [g["after"] for g in got] == [writers] * WORLD  # still in step: the next save succeeds
    assert (target.parent / f"{target.name}-after" / "config.json").exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "how,error,words",
    [
        # Another dtype on one rank: refused when the ranks meet, before the temporary directory.
        ("dtype", "OptionMismatchError", "passed different dtype="),
        ("subgroup", "SaveError", "the save's ranks hold"),
    ],
)
def test_ranks_that_cannot_write_one_checkpoint_fail_together(
    group: RankGroup, ckpt: str, tmp_path: Path, how: str, error: str, words: str
) -> None:
    """Ranks that asked for other headers (another dtype) or a save group smaller than the
    model's mesh: a named error on every rank before any byte is written (the files would
    otherwise hold another rank's offsets, or zeros where no rank of the group wrote)."""
    target = tmp_path / "ckpt"
    got = group.run(cases.case_disagree, timeout=TIMEOUT, ckpt=ckpt, out=str(target), how=how)
    assert all(g["raised"] == error and words in g["text"] for g in got), got
    assert not target.exists() and not any((tmp_path / f"ckpt-{r}").exists() for r in range(WORLD))
    assert _leftovers(tmp_path) == []
    assert all((tmp_path / "ckpt-after" / "config.json").exists() for _ in got)


def test_src_separate_directories(group: RankGroup, ckpt: str, tmp_path: Path) -> None:
    """auto over ranks that cannot see rank 0's directory picks src; only rank 0's copy exists,
    byte for byte the owners output."""
    sep = tmp_path / "separate"
    got = group.run(cases.case_save, timeout=TIMEOUT, ckpt=ckpt, out=str(sep), writers="auto", per_rank=True)
    assert [g["raised"] for g in got] == [None] * WORLD, got
    assert [g["writers"] for g in got] == ["src"] * WORLD, got
    assert got[0]["bytes"] > 0 and got[1]["bytes"] == got[2]["bytes"] == 0, got
    assert not any((sep / str(r)).exists() and any((sep / str(r)).iterdir()) for r in (1, 2))
    shared = tmp_path / "shared"
    got = group.run(cases.case_save, timeout=TIMEOUT, ckpt=ckpt, out=str(shared), writers="auto")
    assert [g["writers"] for g in got] == ["owners"] * WORLD, got
    assert _snapshot(sep / "0" / "ckpt") == _snapshot(shared)
    assert _leftovers(sep / "0") == []


@pytest.fixture(scope="module")
def tiny_fs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 64 KiB tmpfs, where this process may mount one (root in a container that allows it)."""
    where = tmp_path_factory.mktemp("tiny_save")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): ENOSPC is injected above")
    yield where
    subprocess.run(["umount", str(where)], check=False)


@pytest.mark.parametrize("writers", ["owners", "src"])
def test_disk_full_real(group: RankGroup, ckpt: str, tiny_fs: Path, writers: str) -> None:
    """The checkpoint (~40 KB) next to an old one that fills most of a 64 KiB file system."""
    target = tiny_fs / "ckpt"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"\1" * 40_000)
    before = _snapshot(target)
    got = group.run(cases.case_save, timeout=TIMEOUT, ckpt=ckpt, out=str(target), writers=writers)
    assert [g["raised"] for g in got] == ["SaveError"] * WORLD, got
    assert len({g["text"] for g in got}) == 1 and "No space left on device" in got[0]["text"], got
    assert _snapshot(target) == before and _leftovers(tiny_fs) == []
    shutil.rmtree(target)
