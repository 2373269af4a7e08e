"""The directory commit ``save_pretrained`` and ``streamload ingest`` share: a checkpoint directory
is written into a private temporary sibling and appears under its name whole, or not at all.

One process runs it (a save's group rank 0; the collective agreements around it are
``commit.py``'s)::

    d = DirectoryCommit(resolve(out_dir), new_token())  # names <parent>/.<name>.streamload-tmp-<id>
    d.prepare()    # refuse what cannot be swapped, make the parents, remove dead saves' leftovers, mkdir 0700
    ...            # write the files into d.tmp
    d.commit()     # carry the kept entries, the directory's attributes, fsync, swap, settle the old one
    d.discard()    # instead of commit, or after it failed: remove d.tmp; the target is untouched

``replace=True`` (a save): an existing target is swapped with the new directory
(``renameat2(RENAME_EXCHANGE)``; renamed aside first where there is no exchange) after every entry
it holds but the old weight files was carried into the new one by hard links. After the swap the
replaced directory is *settled*, never removed as a tree: only what the new checkpoint provably
holds (the same inode, an unchanged copy) and the old weight files are deleted; an entry made in
the target while the save ran moves into the new checkpoint, or stays in the old directory, which
is then kept under ``.<name>.streamload-old-<id>`` with a warning. ``replace=False`` (ingest): the
target must not exist, and the final rename never replaces one that appeared meanwhile
(``RENAME_NOREPLACE``; elsewhere the name is claimed with ``mkdir`` first).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

from ..errors import SaveError
from .target import (
    OLD_TAG,
    TMP_TAG,
    copy_dir_attrs,
    fsync_path,
    make_parents,
    mount_refusal,
    old_weight_file,
    owner,
    refuse_unswappable,
    remove_stale,
)

log = logging.getLogger("streamload")

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
# errno values that mean "this kernel / file system has no such rename": take the fallback.
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}

# What tells a file unchanged since the carry looked at it: identity, type and mode, size, and
# modification and change times (any write, chmod, link or rename into place moves st_ctime).
Signature = tuple[int, int, int, int, int, int]


def _renameat2(src: str | os.PathLike, dst: str | os.PathLike, flags: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))


def rename_exchange(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """Atomically swaps ``src`` and ``dst`` (both must exist) with Linux ``renameat2``.

    Returns:
        True when swapped; False when this system cannot exchange (no ``renameat2`` in libc, or
        the kernel / file system refuses the flag). Any other failure raises ``OSError``.
    """
    return _renameat2(src, dst, _RENAME_EXCHANGE)


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """Renames ``src`` to ``dst`` unless ``dst`` exists, atomically (Linux ``renameat2``).

    Returns:
        True when renamed; False when this system has no ``RENAME_NOREPLACE``.

    Raises:
        FileExistsError: ``dst`` exists (nothing was renamed). Any other failure: ``OSError``.
    """
    return _renameat2(src, dst, _RENAME_NOREPLACE)


def resolve(out_dir: str | os.PathLike) -> Path:
    """The target as the kernel resolves it: a symlink to a directory is written through (its
    destination replaced, the link kept), and ``..`` after a symlink goes up from its destination."""
    return Path(os.path.realpath(os.fspath(out_dir)))


def new_token() -> str:
    """A temporary directory's id: 16 random hex digits, then its ``owner`` (``remove_stale`` reads it)."""
    return f"{secrets.token_hex(8)}-{owner()}"


def fsync_tree(root: Path, linked: bool = True) -> None:
    """fsyncs every regular file under ``root``, then each directory (deepest first).

    ``linked=False`` skips files with more than one link: a carried hard link's bytes are the
    kept file's, already on disk, and this process may not be allowed to open it (another
    user's file, linkable under ``fs.protected_hardlinks`` by a privileged saver)."""
    dirs = []
    for here, _sub, files in os.walk(root):
        dirs.append(Path(here))
        for f in files:
            p = Path(here) / f
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and (linked or st.st_nlink == 1):
                fsync_path(p)
    for d in reversed(dirs):
        fsync_path(d)


class DirectoryCommit:
    """One directory written through a temporary sibling (see the module's docstring).

    Args:
        target: the directory produced, already resolved (``resolve``).
        token: the temporary directory's id (``new_token``; every rank of a save uses rank 0's).
        replace: True (a save): an existing target is replaced, its other entries kept; False
            (ingest): the target must not exist and is never replaced.

    Attributes:
        tmp: ``<parent>/.<name>.streamload-tmp-<token>``, the directory written into.
        aside: ``<parent>/.<name>.streamload-old-<id>``, where the replaced directory goes.
        swapped: True once the new directory is at ``target`` (the commit is made).
        kept: the replaced directory when it held entries that could not join the new one.
    """

    def __init__(self, target: Path, token: str, *, replace: bool = True) -> None:
        self.target = target
        self.replace = replace
        self.tmp = target.parent / f".{target.name}{TMP_TAG}{token}"
        self.aside = target.parent / f".{target.name}{OLD_TAG}{token.split('-')[0]}"
        self.swapped = False
        self.kept: Path | None = None

    def prepare(self) -> None:
        """Checks the target, creates its missing parents (fsynced), removes the temporary
        directories dead processes left for the same target, and makes ``tmp`` (mode 0700).

        Raises:
            NotADirectoryError: the target exists and is not a directory.
            FileExistsError: the target exists and ``replace`` is False.
            SaveError: the target is or holds a mount point.
            OSError: the parents or the temporary directory cannot be made.
        """
        self._check()
        refuse_unswappable(self.target)
        make_parents(self.target.parent)
        remove_stale(self.target)
        self.tmp.mkdir(mode=0o700)  # private while it is written; the target's mode at the commit

    def _check(self) -> bool:
        """Whether the target exists (as a directory); raises where it may not be written."""
        target = self.target
        if not os.path.lexists(target):
            return False
        if not self.replace:
            raise FileExistsError(errno.EEXIST, "the destination exists", str(target))
        if not target.is_dir() or target.is_symlink():
            raise NotADirectoryError(
                errno.ENOTDIR, "the save target exists and is not a directory", str(target)
            )
        return True

    def commit(self) -> None:
        """Makes ``tmp`` durable and puts it at the target; settles a replaced directory.

        Sets ``swapped`` once the new directory is at the target: from then on nothing raises
        (the commit is made); a late failure (the parent's fsync, the settling) is a warning.

        Raises:
            SaveError: the carry's copies would not fit (hard links failed), or a mount point.
            FileExistsError: ``replace`` is False and the target exists (or appeared meanwhile).
            OSError: the carry, an fsync or the rename failed; the target is untouched.
        """
        present = self._check()
        seen = carry(self.target, self.tmp) if present else {}
        copy_dir_attrs(self.target if present else None, self.tmp)
        fsync_tree(self.tmp, linked=False)
        old = self._swap(present)
        self.swapped = True
        try:
            fsync_path(self.target.parent)
        except OSError as exc:
            # The rename happened: the new directory is in place, only its durability across a
            # crash is unconfirmed. Failing here would report a committed save as not made.
            log.warning(
                "streamload: saved %s, but could not fsync %s: %s", self.target, self.target.parent, exc
            )
        if old is not None:
            self._settle(old, seen)

    def _swap(self, present: bool) -> Path | None:
        """Puts ``tmp`` at the target; returns where the replaced directory now is, if any."""
        target, tmp = self.target, self.tmp
        if not present:
            if not rename_noreplace(tmp, target):
                # No RENAME_NOREPLACE here: claim the name with mkdir (fails if it exists), then
                # rename over that empty directory (fails if anyone wrote into it meanwhile).
                os.mkdir(target, 0o700)
                try:
                    os.rename(tmp, target)
                except BaseException:
                    os.rmdir(target)
                    raise
            return None
        # The new directory leaves the temporary name first: after the exchange the replaced one
        # sits where the new one was, and that must not be a name a cleanup removes (the next
        # save's remove_stale, a surviving rank's discard) while the replaced directory may hold
        # entries made during the save. A crash in between leaves the new directory under the
        # aside name: nothing lost, nothing removed.
        os.rename(tmp, self.aside)
        try:
            exchanged = rename_exchange(self.aside, target)
        except BaseException:
            os.rename(self.aside, tmp)
            raise
        if exchanged:
            return self.aside
        os.rename(self.aside, tmp)
        # No atomic exchange here: rename the old target aside first. A crash between the two
        # renames leaves the old directory under the aside name, never a mix.
        os.rename(target, self.aside)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(self.aside, target)
            raise
        return self.aside

    def _settle(self, old: Path, seen: dict[str, Signature]) -> None:
        """Empties the replaced directory of what the new one holds, or keeps it with a warning."""
        try:
            moved, left = settle(old, self.target, seen)
        except OSError as exc:
            moved, left = [], [f"({exc})"]
        if moved:
            log.info(
                "streamload: saved %s; %d entries made in it while the save ran were moved into it: %s",
                self.target,
                len(moved),
                ", ".join(moved[:5]),
            )
        if left:
            self.kept = old
            log.warning(
                "streamload: saved %s; the directory it replaced is kept at %s, holding %d entries the new "
                "checkpoint does not (changed while the save ran under names the new checkpoint holds, or "
                "mounted): %s",
                self.target,
                old,
                len(left),
                ", ".join(left[:5]),
            )

    def discard(self) -> None:
        """Removes ``tmp`` if it is still there (the new directory leaves that name before the swap;
        the replaced one never takes it). Only the committing process may call it once the commit
        started (another would remove files it is carrying or renaming)."""
        if self.swapped:
            return
        # Every rank of a save that lost a peer removes it at once: what one finds gone, another removed.
        shutil.rmtree(self.tmp, ignore_errors=True)
        if os.path.lexists(self.tmp):
            log.warning("streamload: could not remove %s", self.tmp)


# -- the kept entries: carried into the new directory, settled after the swap ------------------


def signature(st: os.stat_result) -> Signature:
    """A file's ``Signature`` (equal before and after: the file did not change)."""
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class _Carry:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.dev = os.lstat(root).st_dev
        self.seen: dict[str, Signature] = {}
        self.copies: list[tuple[Path, Path, int, str]] = []
        self.dirs: list[tuple[Path, Path]] = []
        self.link_error: OSError | None = None

    def walk(self, src: Path, dst: Path, rel: str) -> None:
        with os.scandir(src) as entries:
            names = sorted(e.name for e in entries)
        for name in names:
            s, d, r = src / name, dst / name, rel + name
            if not rel and old_weight_file(name):
                continue
            st = os.lstat(s)
            is_dir = stat.S_ISDIR(st.st_mode)
            if is_dir and st.st_dev != self.dev:
                raise mount_refusal(self.root, [s])  # a copy then a settle would empty the volume
            if os.path.lexists(d):  # the new save writes this name
                if is_dir and d.is_dir() and not d.is_symlink():
                    self.walk(s, d, r + "/")  # ... into a directory the old one has: merged
                elif not is_dir:
                    self.seen[r] = signature(st)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif is_dir:
                os.mkdir(d, 0o700)
                self.dirs.append((s, d))
                self.walk(s, d, r + "/")
            else:
                try:
                    os.link(s, d, follow_symlinks=False)
                except OSError as exc:  # another device, not permitted, no hard links here
                    self.link_error = self.link_error or exc
                    self.copies.append((s, d, st.st_size, r))
                    self.seen[r] = signature(st)

    def check_room(self, new: Path) -> None:
        need = sum(copy[2] for copy in self.copies)
        vfs = os.statvfs(new)
        free = vfs.f_bavail * vfs.f_frsize
        if need > free:
            why = self.link_error.strerror if self.link_error is not None else "?"
            raise SaveError(
                f"the save keeps {len(self.copies)} files of {self.root} it does not write, and they cannot "
                f"be hard-linked ({why}): copying them needs {need} bytes, but {free} bytes are free there",
                file=str(self.root),
                hint="free space on that file system, or move the files the save does not write out of the target",
            )


def carry(target: Path, new: Path) -> dict[str, Signature]:
    """Carries into ``new`` every entry of ``target`` but its old weight files (``old_weight_file``)
    and the names ``new`` already holds, so the swap keeps them.

    Files are hard-linked (one inode in both directories), symlinks and directories re-made (a
    directory's mode and times copied). Files that cannot be linked are copied, after checking
    that the file system has room for every copy: a carry never fills the disk.

    Args:
        target: the existing directory the save replaces.
        new: the save's temporary directory.

    Returns:
        relative path -> ``Signature``, as the carry saw it, of each file it copied and each file
        the new directory writes over: ``settle`` deletes those only when unchanged.

    Raises:
        SaveError: the copies need more bytes than are free, or a directory is a mount point.
        OSError: a link, a copy or a mkdir failed.
    """
    walk = _Carry(target)
    walk.walk(target, new, "")
    if walk.copies:
        walk.check_room(new)
        for s, d, _size, rel in walk.copies:
            try:
                shutil.copy2(s, d, follow_symlinks=False)
            except PermissionError as exc:
                # Neither linked nor readable by this process (another user's private file): not
                # carried. After the swap ``settle`` moves it into the new directory (a rename
                # needs no read access), or keeps the old directory with a warning naming it.
                log.info("streamload: %s is not carried (%s); it is moved in after the swap", s, exc)
                with contextlib.suppress(OSError):
                    os.unlink(d)
                walk.seen.pop(rel, None)
    # Deepest first, after their files: a read-only directory stays writable until it is filled.
    for s, d in reversed(walk.dirs):
        shutil.copystat(s, d, follow_symlinks=False)
    return walk.seen


def settle(old: Path, new: Path, seen: dict[str, Signature]) -> tuple[list[str], list[str]]:
    """After the swap: deletes from the replaced directory ``old`` only what ``new`` holds.

    Deleted: the old weight files at the top level; every file that is the same inode in ``new``
    (a hard link the carry made) or the same symlink; every file the carry copied, or the new
    save wrote over, that is unchanged since the carry saw it (``seen``); then emptied
    directories. Anything else (made or replaced while the save ran) moves to ``new`` where its
    name is free, else stays. A directory on another device (a mount) is never entered. ``old``
    itself is removed when nothing stays in it.

    Returns:
        (moved, left): relative paths moved into ``new``, and left in ``old``.
    """
    moved: list[str] = []
    left: list[str] = []
    _settle_dir(old, new, "", seen, os.lstat(old).st_dev, moved, left)
    if not left:
        os.rmdir(old)
    return moved, left


def _settle_dir(
    old: Path, new: Path, rel: str, seen: dict[str, Signature], dev: int, moved: list[str], left: list[str]
) -> None:
    with os.scandir(old) as entries:
        names = sorted(e.name for e in entries)
    for name in names:
        o, n, r = old / name, new / name, rel + name
        try:
            st = os.lstat(o)
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev != dev:  # a mount point: neither entered, nor moved, nor removed
                    left.append(r)
                    continue
                if n.is_dir() and not n.is_symlink():
                    before = len(left)
                    _settle_dir(o, n, r + "/", seen, dev, moved, left)
                    if len(left) == before:  # emptied
                        os.rmdir(o)
                    continue
            elif (not rel and old_weight_file(name)) or _held(o, st, n, seen.get(r)):
                os.unlink(o)
                continue
            if _move(o, n):
                moved.append(r)
            else:
                left.append(r)
        except OSError as exc:
            log.warning("streamload: could not settle %s: %s", o, exc)
            left.append(r)


def _held(o: Path, st: os.stat_result, n: Path, sig: Signature | None) -> bool:
    """Whether ``n`` in the new directory holds what ``o`` (a non-directory, stat ``st``) holds."""
    try:
        nst = os.lstat(n)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) == (nst.st_dev, nst.st_ino):
        return True  # one file, hard-linked by the carry: a write to it shows in both
    if stat.S_ISLNK(st.st_mode) and stat.S_ISLNK(nst.st_mode) and os.readlink(o) == os.readlink(n):
        return True
    return sig is not None and sig == signature(st)  # copied, or written over, and unchanged since


def _move(src: Path, dst: Path) -> bool:
    """Renames ``src`` to ``dst`` when ``dst`` is free; whether it did."""
    try:
        if rename_noreplace(src, dst):
            return True
    except FileExistsError:
        return False
    if os.path.lexists(dst):
        return False
    os.rename(src, dst)
    return True
