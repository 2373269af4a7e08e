"""The save's atomic output (streamload.save.commit, streamload.save.directory): a checkpoint
appears only whole, an existing one is replaced atomically, and a failure on any rank is one
SaveError on every rank with the target untouched and no temporary directory left. The rules of
the directory commit `streamload ingest` shares run for both (``how``: save, ingest).

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
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cases_save_commit as cases
import pytest

from streamload.errors import CheckpointError, SaveError
from streamload.save import commit, directory
from streamload.save import target as target_dir
from streamload.save.commit import open_output

WORLD = 3
WRITERS = ["save", "ingest"]  # what writes through the directory commit


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


@pytest.mark.parametrize("how", WRITERS)
def test_stale_temporary_directories_of_dead_saves_are_removed(
    tmp_path: Path, request: pytest.FixtureRequest, how: str
) -> None:
    """A save (or an ingest) killed mid-way left its temporary directory; the next one to the same
    target removes it when the process that made it is gone, and leaves those of live processes, of
    other hosts and of other targets."""
    host = __import__("socket").gethostname()
    target = tmp_path / "ckpt"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    me = f"{os.getpid()}-{target_dir.start_time(os.getpid())}@{host}"
    names = {
        "dead": f".ckpt{commit.TMP_TAG}{'a' * 16}-{pid}-1@{host}",
        "reused_pid": f".ckpt{commit.TMP_TAG}{'b' * 16}-{os.getpid()}-1@{host}",
        "live": f".ckpt{commit.TMP_TAG}{'c' * 16}-{me}",
        "other_host": f".ckpt{commit.TMP_TAG}{'d' * 16}-{pid}-1@elsewhere.example",
        "other_target": f".other{commit.TMP_TAG}{'e' * 16}-{pid}-1@{host}",
        "not_ours": f".ckpt{commit.TMP_TAG}hand-made",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    _write(how, target, request)
    left = {k for k, n in names.items() if (tmp_path / n).exists()}
    assert left == {"live", "other_host", "other_target", "not_ours"}, left


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


# -- the directory commit's rules, for a save and for `streamload ingest` ---------------------


@pytest.fixture(scope="module")
def ingest_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from streamload.tools.synthetic import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ingest") / "src", "qwen2")


def _write(
    how: str, target: Path, request: pytest.FixtureRequest, during: Callable[[Path], None] | None = None
) -> None:
    """Writes a checkpoint at ``target`` by a save or by ``ingest``; ``during(tmp)`` runs while its
    temporary directory is being written."""
    hook = during or (lambda tmp: None)
    if how == "save":
        with open_output(target) as out:
            out.write_file("config.json", b"{}")
            hook(out.tmp_dir)
        return
    from streamload.tools import ingest as ing

    real = ing._write_file

    def write_file(path: Path, *args: Any) -> int:
        hook(path.parent)
        return real(path, *args)

    request.getfixturevalue("monkeypatch").setattr(ing, "_write_file", write_file)
    ing.ingest(request.getfixturevalue("ingest_src"), target)


@pytest.mark.parametrize("how", WRITERS)
def test_temporary_directory_is_private_while_written(
    tmp_path: Path, request: pytest.FixtureRequest, how: str
) -> None:
    """0700 while written; a new target then gets mkdir's default mode, made parents fsynced."""
    modes: list[int] = []
    target = tmp_path / "new" / "ckpt"
    _write(how, target, request, lambda tmp: modes.append(stat.S_IMODE(tmp.stat().st_mode)))
    assert modes == [0o700]
    (tmp_path / "probe").mkdir()
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE((tmp_path / "probe").stat().st_mode)
    assert (target / "config.json").exists() and _leftovers(target.parent) == []


@pytest.mark.parametrize("how", WRITERS)
def test_symlinked_parent_is_written_through(
    tmp_path: Path, request: pytest.FixtureRequest, how: str
) -> None:
    """A destination under a symlinked directory lands in the link's destination, the link kept;
    ``..`` after the link goes up from its destination, as the kernel resolves it."""
    real = tmp_path / "a" / "b"
    real.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    _write(how, link / "ckpt", request)
    assert link.is_symlink() and (real / "ckpt" / "config.json").exists()
    _write(how, link / ".." / "beside", request)  # the kernel: a/beside, not tmp_path/beside
    assert (tmp_path / "a" / "beside" / "config.json").exists() and not (tmp_path / "beside").exists()
    assert _leftovers(tmp_path) == [] and _leftovers(real) == [] and _leftovers(tmp_path / "a") == []


@pytest.mark.parametrize("how", WRITERS)
def test_interrupt_leaves_nothing(tmp_path: Path, request: pytest.FixtureRequest, how: str) -> None:
    def interrupt(tmp: Path) -> None:
        raise KeyboardInterrupt

    target = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        _write(how, target, request, interrupt)
    assert not target.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("noreplace", [True, False], ids=["renameat2", "mkdir-claim"])
def test_ingest_never_replaces_a_destination_that_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, noreplace: bool
) -> None:
    """The destination appears (empty, which a plain rename would replace) between the ingest's
    check and its rename: refused, the directory left as it is, no temporary directory left."""
    target = tmp_path / "ckpt"
    real = directory.fsync_tree

    def fsync_then_appear(root: Path) -> None:
        real(root)
        target.mkdir()

    monkeypatch.setattr(directory, "fsync_tree", fsync_then_appear)
    if not noreplace:
        monkeypatch.setattr(directory, "rename_noreplace", lambda src, dst: False)
    with pytest.raises(CheckpointError, match="destination exists"):
        _write("ingest", target, request)
    assert target.is_dir() and list(target.iterdir()) == [] and _leftovers(tmp_path) == []


# -- the replaced directory: settled after the swap, never removed as a tree -------------------


def _carry_then(monkeypatch: pytest.MonkeyPatch, change: Callable[[Path], None]) -> None:
    """Runs ``change(target)`` right after the carry, before the swap."""
    real = directory.carry

    def carry(target: Path, new: Path) -> dict:
        seen = real(target, new)
        change(target)
        return seen

    monkeypatch.setattr(directory, "carry", carry)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_entries_made_during_the_save_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """Files made in the target after the carry, before the swap (top level, in a carried
    subdirectory, a new subdirectory) join the new checkpoint; a carried file written in place
    shows its new bytes (one inode); nothing is left behind. (The old commit removed the replaced
    directory as a tree: notes.txt, sub/b.txt and newdir were lost.)"""
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    (target / "sub").mkdir()
    (target / "sub" / "a.txt").write_text("a")
    (target / "tokenizer.json").write_text("tok")

    def change(old: Path) -> None:
        (old / "notes.txt").write_text("written during the save")
        (old / "sub" / "b.txt").write_text("b")
        (old / "newdir").mkdir()
        (old / "newdir" / "c.txt").write_text("c")
        with open(old / "tokenizer.json", "a") as f:
            f.write("+more")

    _carry_then(monkeypatch, change)
    if not exchange:
        monkeypatch.setattr(directory, "rename_exchange", lambda src, dst: False)
    with open_output(target) as out:
        out.create_files({"model.safetensors": 3})
        os.pwrite(out.open("model.safetensors"), b"new", 0)
    assert _snapshot(target) == {
        "model.safetensors": b"new",
        "config.json": b'{"old": 1}',
        "tokenizer.json": b"tok+more",
        "sub/a.txt": b"a",
        "sub/b.txt": b"b",
        "notes.txt": b"written during the save",
        "newdir/c.txt": b"c",
    }
    assert _leftovers(tmp_path) == []


def test_entries_replaced_during_the_save_keep_the_old_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A carried file replaced (a new inode) and a file the save writes over changed, both after
    the carry: their names are the new checkpoint's, so the replaced directory is kept, holding
    just those, under a visible name that the warning gives."""
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    (target / "tokenizer.json").write_text("tok")

    def change(old: Path) -> None:
        (old / "tokenizer.tmp").write_text("tok v2")
        os.replace(old / "tokenizer.tmp", old / "tokenizer.json")
        (old / "config.json").write_text('{"changed": 1}')

    _carry_then(monkeypatch, change)
    with caplog.at_level("WARNING", logger="streamload"):
        with open_output(target) as out:
            out.write_file("config.json", b'{"new": 1}')
    assert _snapshot(target) == {"config.json": b'{"new": 1}', "tokenizer.json": b"tok"}
    kept = _leftovers(tmp_path)
    assert len(kept) == 1 and commit.OLD_TAG in kept[0] and kept[0] in caplog.text
    assert _snapshot(tmp_path / kept[0]) == {"tokenizer.json": b"tok v2", "config.json": b'{"changed": 1}'}


@pytest.mark.parametrize("err", [errno.EPERM, errno.EXDEV])
@pytest.mark.parametrize("room", [False, True], ids=["full", "room"])
def test_carry_copies_only_what_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, room: bool
) -> None:
    """Hard links fail: the copies' bytes are compared with the free space first. Too little: a
    SaveError naming both numbers and the target, before any copy; the target untouched and no
    temporary directory left. Enough: copied, the same bytes."""
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    (target / "tokenizer.json").write_bytes(b"t" * 1000)
    (target / "sub").mkdir()
    (target / "sub" / "a.bin").write_bytes(b"a" * 3000)
    before = _snapshot(target)
    need = sum(len(v) for k, v in before.items() if k != "model.safetensors")
    free = need if room else need - 1

    def no_link(*args: object, **kwargs: object) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free, f_frsize=1))
    if not room:
        with pytest.raises(SaveError) as info:
            with open_output(target) as out:
                out.create_files({"model.safetensors": 3})
        text = str(info.value)
        assert f"needs {need} bytes" in text and f"{free} bytes are free" in text and str(target) in text
        assert os.strerror(err) in text
        assert _snapshot(target) == before and _leftovers(tmp_path) == []
        return
    with open_output(target) as out:
        out.create_files({"model.safetensors": 3})
    assert _snapshot(target) == {**before, "model.safetensors": b"\0\0\0"}
    assert _leftovers(tmp_path) == []


def test_nested_mount_points_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mount at any depth below the target (``/proc/self/mountinfo``, simulated): refused before
    anything is written, as one at the top level is."""
    target = tmp_path / "my ckpt"
    before = _old_checkpoint(target)
    (target / "a" / "b").mkdir(parents=True)
    point = str(target / "a" / "b").replace(" ", "\\040")
    info = tmp_path / "mountinfo"
    info.write_text(f"36 35 98:0 / {point} rw,noatime master:1 - tmpfs tmpfs rw\n")
    monkeypatch.setattr(target_dir, "MOUNTINFO", str(info))
    with pytest.raises(SaveError, match="mount point.*a/b"):
        open_output(target)
    assert _snapshot(target) == before and _leftovers(tmp_path) == []


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


@pytest.fixture(scope="module")
def tiny_fs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 64 KiB tmpfs, where this process may mount one (root in a container that allows it)."""
    where = tmp_path_factory.mktemp("tiny")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): disk full is tested by injection"
        )
    yield where
    subprocess.run(["umount", str(where)], check=False)


@pytest.mark.parametrize("mounted", ["inside", "itself"])
def test_mount_points_are_refused_simulated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mounted: str
) -> None:
    """The refusal where no tmpfs can be mounted: ``os.path.ismount`` says ``ckpt/data`` (or
    ``ckpt``) is a mount point; nothing is written, nothing removed."""
    target = tmp_path / "ckpt"
    before = _old_checkpoint(target)
    (target / "data").mkdir()
    (target / "data" / "keep.bin").write_bytes(b"on the volume")
    before["data/keep.bin"] = b"on the volume"
    mount = target / "data" if mounted == "inside" else target
    monkeypatch.setattr(target_dir.os.path, "ismount", lambda p: Path(p) == mount)
    with pytest.raises(SaveError, match="mount point"):
        open_output(target)
    assert _snapshot(target) == before and _leftovers(tmp_path) == []


def test_mounts_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A target that holds a mount (``ckpt/data`` a volume) or is one: the directory swap would
    empty the mounted file system (its files copied, the old directory removed) or fail with
    EBUSY after the whole write. Refused up front; the mount's files are untouched."""
    target = tmp_path / "ckpt"
    before = _old_checkpoint(target)
    data = target / "data"
    data.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(data)], capture_output=True)
    if proc.returncode:
        pytest.skip(
            f"this process may not mount a tmpfs ({proc.stderr.decode().strip()}): the refusal itself"
            " is tested with simulated mount points (test_mount_points_are_refused_simulated)"
        )
    try:
        (data / "keep.bin").write_bytes(b"on the volume")
        with pytest.raises(SaveError, match="mount point"):
            open_output(target)
        assert (data / "keep.bin").read_bytes() == b"on the volume" and _leftovers(tmp_path) == []
        with pytest.raises(SaveError, match="mount point"):
            open_output(data)  # the target is the mount itself
        assert (data / "keep.bin").read_bytes() == b"on the volume" and _leftovers(target) == []
    finally:
        subprocess.run(["umount", str(data)], check=False)
    assert (target / "model.safetensors").read_bytes() == before["model.safetensors"]


def test_disk_full_real(tiny_fs: Path) -> None:
    target = tiny_fs / "ckpt"
    before = _old_checkpoint(target)
    with pytest.raises(SaveError) as info:
        with open_output(target) as out:
            out.create_files({"model.safetensors": 1 << 20})  # sized sparse: only the writes need space
            fd = out.open("model.safetensors")
            for off in range(0, 1 << 20, 1 << 16):
                os.pwrite(fd, b"\1" * (1 << 16), off)
    assert "No space left on device" in str(info.value) and "is full" in (info.value.hint or "")
    assert _snapshot(target) == before and _leftovers(tiny_fs) == []


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
