"""The save's target directory: what a save keeps of it, what it refuses, what it cleans up.

- Kept: every entry but the old weights in transformers' names (``old_weight_file``), carried into
  the new directory (``directory.carry``); the directory's mode, owner and ACLs (``copy_dir_attrs``).
- Refused before any write: a target that is or holds a mount point (``refuse_unswappable``).
- Cleaned up: temporary directories of earlier saves whose process is gone (``remove_stale``),
  named after their owner (``owner``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import stat
from pathlib import Path

from ..errors import SaveError

log = logging.getLogger("streamload")

TMP_TAG = ".streamload-tmp-"
OLD_TAG = ".streamload-old-"


def fsync_path(path: Path) -> None:
    """fsyncs a file or a directory (a directory: the names in it, after a rename or mkdir)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The old checkpoint's weight files, in transformers' names for its weights: replaced by the new
# save's, never carried over. Any other file is kept, other ``*.safetensors`` included
# (``adapter_model.safetensors``, ``model_ema.safetensors``, ``consolidated.safetensors``), as
# transformers' own save_pretrained keeps them.
_OLD_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


def old_weight_file(name: str) -> bool:
    """Whether ``name`` is a weight file of the checkpoint a save replaces (not carried over)."""
    return _OLD_WEIGHTS.fullmatch(name) is not None


def cwd_inside(target: Path) -> str | None:
    """This process's working directory when it is ``target`` or lies under it, else None."""
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    inside = cwd == str(target) or cwd.startswith(str(target).rstrip(os.sep) + os.sep)
    return cwd if inside else None


def owner() -> str:
    """``<pid>-<start>@<host>``: who made a temporary directory (``remove_stale`` reads it)."""
    return f"{os.getpid()}-{start_time(os.getpid())}@{socket.gethostname()}"


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (Linux), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


_STALE = re.compile(r"[0-9a-f]{16}-(?P<pid>\d+)-(?P<start>\d+)@(?P<host>.+)")


def remove_stale(target: Path) -> list[Path]:
    """Removes the temporary directories earlier saves to ``target`` left when their process
    died (killed, out of memory, the node lost): only ours by name, only made on this host, and
    only when the process that made it is gone (its pid no longer runs, or runs a newer process).
    Directories from other hosts or live processes are left. Returns what was removed."""
    prefix = f".{target.name}{TMP_TAG}"
    removed = []
    host = socket.gethostname()
    try:
        names = [n for n in os.listdir(target.parent) if n.startswith(prefix)]
    except OSError:
        return []
    for name in names:
        m = _STALE.fullmatch(name[len(prefix) :])
        path = target.parent / name
        if m is None or m["host"] != host or not path.is_dir() or path.is_symlink():
            continue
        pid, start = int(m["pid"]), int(m["start"])
        if os.path.exists(f"/proc/{pid}") and start_time(pid) in (start, 0):
            continue  # its process still runs
        shutil.rmtree(path, ignore_errors=True)
        log.info("streamload: removed %s, left by a save whose process (pid %d) is gone", path, pid)
        removed.append(path)
    return removed


def make_parents(parent: Path) -> None:
    """Creates ``parent`` and its missing ancestors, each fsynced into its own parent (a crash
    must not lose the directories a committed save lives in)."""
    missing = []
    p = parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir()
        fsync_path(d.parent)


MOUNTINFO = "/proc/self/mountinfo"


def mounts_under(target: Path) -> list[Path]:
    """The mount points strictly below ``target``, at any depth (Linux; none where unknown)."""
    try:
        with open(MOUNTINFO) as f:
            lines = f.readlines()
    except OSError:
        return []
    prefix = str(target).rstrip(os.sep) + os.sep
    points = []
    for line in lines:
        fields = line.split()
        if len(fields) > 4:  # the fifth field; space, tab, newline, backslash as octal escapes
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
            if point.startswith(prefix):
                points.append(Path(point))
    return points


def mount_refusal(target: Path, mounts: list[Path]) -> SaveError:
    """The error for a target that is or holds the mount points ``mounts``."""
    return SaveError(
        f"the save target is or holds a mount point ({', '.join(map(str, mounts[:3]))}): a save replaces "
        "its target directory as a whole, which would empty or fail on a mounted file system",
        file=str(target),
        hint="save into a directory of its own (a subdirectory of the mount, or beside it)",
    )


def refuse_unswappable(target: Path) -> None:
    """Raises before anything is written when the commit's directory swap would destroy or fail:
    the target is a mount point (the rename fails with EBUSY), or holds one at any depth (its files
    would be copied into the new directory and removed from the volume)."""
    if not target.is_dir():
        return
    mounts = [target] if os.path.ismount(target) else []
    with os.scandir(target) as entries:
        mounts += [
            Path(e.path) for e in entries if e.is_dir(follow_symlinks=False) and os.path.ismount(e.path)
        ]
    mounts += [m for m in mounts_under(target) if m not in mounts]
    if mounts:
        raise mount_refusal(target, mounts)


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else by setting it back at once."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def copy_dir_attrs(old: Path | None, new: Path) -> None:
    """Gives ``new`` (the save's private temporary directory) what the directory it replaces had:
    its mode, owner and group where this process may set them, and its ACLs and other extended
    attributes; a new target gets ``mkdir``'s default mode (0o777 less the umask)."""
    if old is None:
        os.chmod(new, 0o777 & ~_umask())
        return
    st = os.stat(old)
    with contextlib.suppress(PermissionError):
        os.chown(new, st.st_uid, st.st_gid)
    for name in _xattrs(old):
        with contextlib.suppress(OSError):
            os.setxattr(new, name, os.getxattr(old, name))
    os.chmod(new, stat.S_IMODE(st.st_mode))  # after the ACLs: chmod sets the ACL's mask entry too


def _xattrs(path: Path) -> list[str]:
    try:
        return os.listxattr(path)
    except OSError:  # no extended attributes on this file system
        return []
