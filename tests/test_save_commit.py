"""The save's atomic output (streamload.save.commit, streamload.save.directory): a checkpoint
appears only whole, an existing one is replaced atomically, and a failure on any rank is one
SaveError on every rank with the target untouched and no temporary directory left. The rules of
the directory transaction `streamload ingest` shares are in tests/test_save_directory.py.

Single-process tests first, then 3 gloo ranks (tests/cases_save_commit.py). Permission
denied runs in a child without root's CAP_DAC_OVERRIDE (setpriv); disk full runs against a
real 64 KiB tmpfs where this process may mount one, and by injection (ENOSPC from os.pwrite)
everywhere."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import cases_save_commit as cases
import pytest

from streamload.errors import SaveError
from streamload.save import commit, directory
from streamload.save.commit import open_output

WORLD = 3


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if commit.TMP_TAG in p.name or commit.OLD_TAG in p.name)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _old_checkpoint(target: Path) -> dict[str, bytes]:
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"old weights" * 100)
    (target / "config.json").write_text('{"old": 1}')
    return _snapshot(target)


# -- one process ----------------------------------------------------------------------


def test_single_process_commit(tmp_path: Path) -> None:
    target = tmp_path / "out" / "ckpt"  # the parent is created too
    with open_output(target) as out:
        assert out.tmp_dir.parent == target.parent and out.tmp_dir.name.startswith(".ckpt" + commit.TMP_TAG)
        out.create_files({"a.safetensors": 8, "sub/b.bin": 3})
        os.pwrite(out.open("a.safetensors"), b"abcd", 4)
        os.pwrite(out.open("sub/b.bin"), b"xyz", 0)
        out.write_file("config.json", b"{}")
        assert not target.exists()  # nothing under the target's name before the commit
    assert _snapshot(target) == {"a.safetensors": b"\0\0\0\0abcd", "sub/b.bin": b"xyz", "config.json": b"{}"}
    assert _leftovers(target.parent) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_replaces_existing_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool) -> None:
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    (target / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    if not exchange:
        monkeypatch.setattr(directory, "rename_exchange", lambda src, dst: False)
    with open_output(target) as out:
        out.create_files({"model.safetensors": 3})
        os.pwrite(out.open("model.safetensors"), b"new", 0)
    # The weights are replaced (a stale shard of the old checkpoint does not survive); the
    # old config.json, which this save does not write, is kept as transformers keeps it.
    assert _snapshot(target) == {"model.safetensors": b"new", "config.json": b'{"old": 1}'}
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_replace_keeps_unrelated_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """Files the new save does not write survive the swap (hard-linked over, same content);
    the old weight shards and their index are gone; the new files are the new save's."""
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "tokenizer.json").write_text('{"tok": 1}')
    (target / "config.json").write_text('{"old": 1}')
    (target / "sub" / "deeper").mkdir(parents=True)
    (target / "sub" / "notes.txt").write_text("keep me")
    (target / "sub" / "deeper" / "x.safetensors").write_bytes(b"another checkpoint's weights")
    (target / "model-00001-of-00002.safetensors").write_bytes(b"old shard 1")
    (target / "model-00002-of-00002.safetensors").write_bytes(b"old shard 2")
    (target / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (target / "link").symlink_to("tokenizer.json")
    for other in ("adapter_model.safetensors", "model_ema.safetensors", "consolidated.safetensors"):
        (target / other).write_bytes(other.encode())  # not the old checkpoint's weights: kept
    inode = (target / "tokenizer.json").stat().st_ino
    if not exchange:
        monkeypatch.setattr(directory, "rename_exchange", lambda src, dst: False)
    with open_output(target) as out:
        out.create_files({"model.safetensors": 3})
        os.pwrite(out.open("model.safetensors"), b"new", 0)
        out.write_file("config.json", b'{"new": 1}')
    assert _snapshot(target) == {
        "model.safetensors": b"new",
        "config.json": b'{"new": 1}',  # written by the new save: the old one is not carried over it
        "tokenizer.json": b'{"tok": 1}',
        "sub/notes.txt": b"keep me",
        "sub/deeper/x.safetensors": b"another checkpoint's weights",  # only top-level weights go
        "link": b'{"tok": 1}',
        "adapter_model.safetensors": b"adapter_model.safetensors",
        "model_ema.safetensors": b"model_ema.safetensors",
        "consolidated.safetensors": b"consolidated.safetensors",
    }
    assert (target / "link").is_symlink() and os.readlink(target / "link") == "tokenizer.json"
    assert (target / "tokenizer.json").stat().st_ino == inode  # linked, not copied
    assert _leftovers(tmp_path) == []


def test_carry_copies_where_linking_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "tokenizer.json").write_text("tok")
    (target / "sub").mkdir()
    (target / "sub" / "a.txt").write_text("a")

    def no_link(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(commit.os, "link", no_link)
    with open_output(target) as out:
        out.create_files({"model.safetensors": 1})
    assert _snapshot(target) == {"model.safetensors": b"\0", "tokenizer.json": b"tok", "sub/a.txt": b"a"}
    assert _leftovers(tmp_path) == []


def test_carry_failure_leaves_target_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ckpt"
    before = _old_checkpoint(target)
    (target / "tokenizer.json").write_text("tok")
    before = _snapshot(target)

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "link", fail)
    monkeypatch.setattr(shutil, "copy2", fail)  # the copy where linking fails: no room either
    with pytest.raises(SaveError, match="No space left on device"):
        with open_output(target) as out:
            out.create_files({"model.safetensors": 1})
    assert _snapshot(target) == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_failure_after_the_rename_is_a_committed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, exchange: bool
) -> None:
    """The parent's fsync fails after the swap: the new checkpoint stays in place, the save
    reports success with a warning, and the old copy is removed (no leftovers)."""
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    real = directory.fsync_path

    def fsync(path: Path) -> None:
        if Path(path) == tmp_path:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(path)

    monkeypatch.setattr(directory, "fsync_path", fsync)
    if not exchange:
        monkeypatch.setattr(directory, "rename_exchange", lambda src, dst: False)
    with caplog.at_level("WARNING", logger="streamload"):
        with open_output(target) as out:
            out.create_files({"model.safetensors": 3})
            os.pwrite(out.open("model.safetensors"), b"new", 0)
    assert _snapshot(target) == {"model.safetensors": b"new", "config.json": b'{"old": 1}'}
    assert "could not fsync" in caplog.text and "Input/output error" in caplog.text
    assert _leftovers(tmp_path) == []


def test_rename_exchange_swaps(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    assert directory.rename_exchange(a, b)  # Linux with renameat2: the swap itself, atomic
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"
    with pytest.raises(FileNotFoundError):
        directory.rename_exchange(tmp_path / "missing", b)


def test_failure_leaves_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    before = _old_checkpoint(target)
    with pytest.raises(SaveError) as info:
        with open_output(target) as out:
            out.create_files({"model.safetensors": 16})
            os.pwrite(out.open("model.safetensors"), b"half", 0)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    err = info.value
    assert err.rank == 0 and "No space left on device" in str(err) and "is full" in (err.hint or "")
    assert isinstance(err.__cause__, OSError)
    assert _snapshot(target) == before
    assert _leftovers(tmp_path) == []


def test_commit_failure_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ckpt"
    before = _old_checkpoint(target)

    def refuse(src: object, dst: object) -> bool:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(directory, "rename_exchange", refuse)
    with pytest.raises(SaveError, match="Input/output error"):
        with open_output(target) as out:
            out.create_files({"model.safetensors": 1})
    assert _snapshot(target) == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False])
def test_private_target_stays_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """The replaced directory keeps its mode (a 0700 target is not made 0755) and the temporary
    directory is private while the save runs; a new target gets mkdir's default mode."""
    if not exchange:
        monkeypatch.setattr(directory, "rename_exchange", lambda src, dst: False)
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    os.chmod(target, 0o700)
    with open_output(target) as out:
        out.write_file("config.json", b"{}")
        assert stat.S_IMODE(out.tmp_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    os.chmod(target, 0o750)
    with open_output(target) as out:
        out.write_file("config.json", b"{}")
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    fresh = tmp_path / "fresh"
    with open_output(fresh) as out:
        out.write_file("config.json", b"{}")
    (tmp_path / "probe").mkdir()
    assert stat.S_IMODE(fresh.stat().st_mode) == stat.S_IMODE((tmp_path / "probe").stat().st_mode)


def test_symlinked_target_is_saved_through(tmp_path: Path) -> None:
    """A target that is a symlink to a directory: the directory it names is replaced, the link
    stays a link (as transformers writes through it). ``..`` after a symlink goes up from the
    link's destination, as the kernel resolves it."""
    real = tmp_path / "a" / "b" / "real"
    _old_checkpoint(real)
    (real / "tokenizer.json").write_text("tok")
    link = tmp_path / "link"
    link.symlink_to(real)
    with open_output(link) as out:
        out.write_file("config.json", b'{"new": 1}')
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert _snapshot(real) == {"config.json": b'{"new": 1}', "tokenizer.json": b"tok"}
    with open_output(link / ".." / "beside") as out:  # the kernel: a/b/beside, not tmp_path/beside
        out.write_file("config.json", b"{}")
    assert (tmp_path / "a" / "b" / "beside" / "config.json").exists() and not (tmp_path / "beside").exists()
    assert _leftovers(tmp_path) == [] and _leftovers(real.parent) == []


@pytest.mark.parametrize("where", [".", "sub"])
def test_saving_into_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """``save_pretrained(model, ".")`` (or a target holding the working directory): the swap
    replaces that directory; the process is back in the same path, in the new one, after it."""
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    (target / "sub").mkdir()
    (target / "sub" / "notes.txt").write_text("kept")
    monkeypatch.chdir(target / where)
    with open_output(Path(".") if where == "." else Path("..")) as out:
        out.write_file("config.json", b'{"new": 1}')
    assert os.getcwd() == str(target / where)
    assert Path("notes.txt" if where == "sub" else "config.json").exists()  # a relative open works
    assert (target / "config.json").read_bytes() == b'{"new": 1}'


def test_target_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.write_text("not a directory")
    with pytest.raises(SaveError, match="not a directory"):
        open_output(target)
    assert target.read_text() == "not a directory" and _leftovers(tmp_path) == []


def test_bad_names_refused(tmp_path: Path) -> None:
    out = open_output(tmp_path / "ckpt")
    for name in ("../escape", "/abs", ""):
        with pytest.raises(ValueError):
            out.path(name)
    out.finish()


CHILD = r"""
import json, os, sys
from streamload.errors import SaveError
from streamload.save import target as target_dir
from streamload.save.commit import open_output
try:
    with open_output(sys.argv[1]) as out:
        out.create_files({"model.safetensors": 4})
    print(json.dumps({"raised": None}))
except SaveError as exc:
    print(json.dumps({"raised": "SaveError", "text": str(exc), "rank": exc.rank}))
"""


def _unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make a directory read-only for this process")
    return [setpriv, "--inh-caps=-dac_override", "--bounding-set=-dac_override"]


def test_permission_denied(tmp_path: Path) -> None:
    """A read-only parent: the temporary directory cannot be made; SaveError says so, the
    existing checkpoint there is untouched."""
    import json

    parent = tmp_path / "ro"
    target = parent / "ckpt"
    before = _old_checkpoint(target)
    parent.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        proc = subprocess.run(
            [*_unprivileged(), sys.executable, "-c", CHILD, str(target)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        parent.chmod(stat.S_IRWXU)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["raised"] == "SaveError" and "Permission denied" in got["text"], got
    assert "cannot write to" in got["text"]
    assert _snapshot(target) == before and _leftovers(parent) == []


# -- 3 gloo ranks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def group3():
    from rank_group import RankGroup

    g = RankGroup(WORLD)
    yield g
    g.close()


def _target(tmp_path: Path) -> Path:
    return tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"


def test_ranks_commit(group3, tmp_path: Path) -> None:
    target = _target(tmp_path)
    before = _old_checkpoint(target)
    assert before
    got = group3.run(cases.case_save, timeout=60, target=str(target))
    assert [g["raised"] for g in got] == [None] * WORLD, got
    assert _snapshot(target) == {  # the old weights replaced, its config (not written now) kept
        "data.bin": cases.expected(WORLD),
        "index.json": b'{"ok": true}',
        "config.json": b'{"old": 1}',
    }
    assert _leftovers(tmp_path) == []


def test_ranks_same_tmp_and_shared(group3, tmp_path: Path) -> None:
    got = group3.run(cases.case_same_tmp, timeout=60, target=str(_target(tmp_path)))
    assert len({g["tmp"] for g in got}) == 1 and all(g["shared"] for g in got), got
    assert not any(g["probe_left"] for g in got)


def test_ranks_on_other_hosts_share_by_token(group3, tmp_path: Path) -> None:
    got = group3.run(cases.case_shared_across_hosts, timeout=60, target=str(_target(tmp_path)))
    assert all(g["shared"] for g in got), got


def test_ranks_not_shared(group3, tmp_path: Path) -> None:
    got = group3.run(cases.case_not_shared, timeout=60, root=str(tmp_path))
    assert [g["shared"] for g in got] == [False] * WORLD


@pytest.mark.parametrize(
    "fail,fail_rank,words",
    [
        ("enospc", 1, "No space left on device"),
        ("enospc", 0, "No space left on device"),
        ("fsync", 2, "Input/output error"),
        ("rename", 0, "Input/output error"),
    ],
)
def test_ranks_failure_agreed(group3, tmp_path: Path, fail: str, fail_rank: int, words: str) -> None:
    target = _target(tmp_path)
    before = _old_checkpoint(target)
    got = group3.run(cases.case_save, timeout=60, target=str(target), fail=fail, fail_rank=fail_rank)
    assert [g["raised"] for g in got] == ["SaveError"] * WORLD, got
    assert len({g["text"] for g in got}) == 1, got  # the same error on every rank
    assert all(g["rank"] == fail_rank and words in g["text"] for g in got), got
    assert words in got[fail_rank]["cause"]  # chained to the failing rank's own exception
    assert _snapshot(target) == before
    assert _leftovers(tmp_path) == []


def test_ranks_rename_aside(group3, tmp_path: Path) -> None:
    target = _target(tmp_path)
    _old_checkpoint(target)
    got = group3.run(cases.case_save, timeout=60, target=str(target), fail="no-exchange")
    assert [g["raised"] for g in got] == [None] * WORLD, got
    assert _snapshot(target)["data.bin"] == cases.expected(WORLD)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("fail_rank", [1, 0])
def test_ranks_interrupt(group3, tmp_path: Path, fail_rank: int) -> None:
    """KeyboardInterrupt mid-write on one rank: it re-raises the interrupt after cleaning up,
    the others raise SaveError naming it; nobody hangs (the run's timeout is the proof)."""
    target = _target(tmp_path)
    before = _old_checkpoint(target)
    got = group3.run(cases.case_save, timeout=60, target=str(target), fail="interrupt", fail_rank=fail_rank)
    assert got[fail_rank]["raised"] == "KeyboardInterrupt", got
    others = [g for r, g in enumerate(got) if r != fail_rank]
    assert all(g["raised"] == "SaveError" and g["rank"] == fail_rank for g in others), got
    assert "KeyboardInterrupt" in others[0]["text"]
    assert _snapshot(target) == before and _leftovers(tmp_path) == []


def test_ranks_bad_target(group3, tmp_path: Path) -> None:
    target = _target(tmp_path)
    target.write_text("a file")
    got = group3.run(cases.case_bad_target, timeout=60, target=str(target))
    assert [g["raised"] for g in got] == ["SaveError"] * WORLD and all(g["rank"] == 0 for g in got), got
    assert target.read_text() == "a file" and _leftovers(tmp_path) == []


def test_ranks_disk_full_real(group3, tiny_fs: Path) -> None:
    """Every rank writes its slice into a tmpfs too small for all of them: the rank whose
    write hits ENOSPC is named on every rank and the old checkpoint survives."""
    target = tiny_fs / f"ckpt-{uuid.uuid4().hex[:6]}"
    before = _old_checkpoint(target)
    got = group3.run(cases.case_save_big, timeout=60, target=str(target))
    assert [g["raised"] for g in got] == ["SaveError"] * WORLD, got
    assert len({g["text"] for g in got}) == 1 and "No space left on device" in got[0]["text"], got
    assert _snapshot(target) == before and _leftovers(tiny_fs) == []
    shutil.rmtree(target)
