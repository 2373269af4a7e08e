"""The directory transaction a save and `streamload ingest` share (streamload.save.directory):
the rules run for both (``how``: save, ingest): temporary directories of dead processes removed,
private while written, symlinks written through, nothing left when interrupted; the replaced
directory settled (entries made during the save kept), copies only where they fit, mount points
refused, a real disk full. The collective commit is tests/test_save_commit.py."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from streamload.errors import CheckpointError, SaveError
from streamload.save import commit, directory
from streamload.save import target as target_dir
from streamload.save.commit import open_output

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

    def fsync_then_appear(root: Path, linked: bool = True) -> None:
        real(root, linked)
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


_DIE_AFTER_SWAP = """
import os, signal, sys
from torch import nn
import streamload
from streamload.save import directory
target, die = sys.argv[1], sys.argv[2] == "die"
if die:
    real = directory.carry
    def carry(t, n):
        seen = real(t, n)
        open(os.path.join(t, "made_during_save.txt"), "w").write("precious")
        return seen
    directory.carry = carry
    directory.DirectoryCommit._settle = lambda self, old, seen: os.kill(os.getpid(), signal.SIGKILL)
streamload.save_pretrained(nn.Linear(4, 4), target)
"""


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_a_save_killed_after_the_swap_loses_nothing(tmp_path: Path, exchange: bool) -> None:
    """SIGKILL right after the swap, before the replaced directory is settled (it holds a file
    made during the save), then another save to the same target: the replaced directory is
    under a name no cleanup removes. (Before: after the exchange it sat at the temporary name,
    and the next save's stale-directory cleanup removed it, the file made during the save too.)"""
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("n")
    script = _DIE_AFTER_SWAP
    if not exchange:
        script = script.replace("if die:", "directory.rename_exchange = lambda a, b: False\nif die:")
    first = subprocess.run([sys.executable, "-c", script, str(target), "die"], capture_output=True)
    assert first.returncode == -9, first.stderr[-2000:]
    second = subprocess.run([sys.executable, "-c", script, str(target), "ok"], capture_output=True)
    assert second.returncode == 0, second.stderr[-2000:]
    kept = [p for p in tmp_path.iterdir() if target_dir.OLD_TAG in p.name]
    assert len(kept) == 1 and (kept[0] / "made_during_save.txt").read_text() == "precious", kept
    assert (target / "notes.txt").read_text() == "n" and (target / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if target_dir.TMP_TAG in p.name]


def test_ctrl_c_during_a_one_process_commit_stays_an_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process (no meeting defers the signal): a Ctrl-C inside the carry is a
    KeyboardInterrupt, not a SaveError; the target is untouched, nothing left. (Before:
    SaveError "save failed: KeyboardInterrupt".)"""
    target = tmp_path / "ckpt"
    before = _old_checkpoint(target)

    def interrupted(t: Path, n: Path) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(directory, "carry", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with open_output(target) as out:
            out.write_file("config.json", b"{}")
    assert _snapshot(target) == before and _leftovers(tmp_path) == []


def test_another_users_private_file_is_kept(tmp_path: Path) -> None:
    """A file of another user this process may neither read nor link (mode 000, a saver without
    CAP_DAC_OVERRIDE / DAC_READ_SEARCH / FOWNER, as a plain user is): the save succeeds and the
    file stays, its owner and mode too (moved in after the swap). (Before: SaveError, permission
    denied, with a hint that the directory was not writable.)"""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root with setpriv to give a file to another user and drop the capabilities")
    caps = "-dac_override,-dac_read_search,-fowner"
    tmp_path.chmod(0o777)
    target = tmp_path / "ckpt"
    _old_checkpoint(target)
    private = target / "private.txt"
    private.write_text("secret")
    os.chown(private, 65534, 65534)
    private.chmod(0)
    script = "import sys, torch, streamload; streamload.save_pretrained(torch.nn.Linear(8, 8), sys.argv[1])"
    proc = subprocess.run(
        [setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}", sys.executable, "-c", script, str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    st = os.lstat(private)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (65534, 0) and private.read_text() == "secret"
    assert (target / "model.safetensors").read_bytes() != b"old weights" * 100
    assert _leftovers(tmp_path) == []
