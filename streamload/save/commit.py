"""Atomic output: a save writes into a temporary sibling directory and the
checkpoint appears under its name only after every rank agreed that its
writes succeeded, so the target is never a half-written checkpoint.

The lifecycle, collective over the save's process group (every rank calls
every step, in order)::

    out = open_output(out_dir, group)   # rank 0 makes <parent>/.<name>.streamload-tmp-<id>
    out.create_files({"model.safetensors": n})   # rank 0 creates and sizes; agreed
    fd = out.open("model.safetensors")  # a writer opens (O_WRONLY), writes with os.pwrite
    out.finish(ok=True)                 # fsync, agree, rename into place (or clean up)

``finish`` fsyncs every descriptor ``open`` handed out, all-gathers whether
each rank's writes succeeded, and then group rank 0 commits the directory
(``directory.DirectoryCommit``, shared with ``streamload ingest``): the
existing target's entries the save does not write are carried over, all but
its old weight files; the new directory takes the old one's mode, owner and
ACLs, is fsynced and swapped into place; the replaced directory is settled
(emptied of what the new one holds, kept with a warning where entries made
during the save could not join). A failure on any rank is one ``SaveError``
on every rank (naming the failing rank and its cause), raised after the
temporary directory was removed; the target is untouched. Once the new
checkpoint is in place the save is committed: a later failure (the parent
directory's fsync, the settling) is logged as a warning, never an error.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RemoteRankError, SaveError
from ..transport.arrival import lost_peer, take_interrupt
from ..transport.collectives import all_gather_object, broadcast_object
from ..transport.protocol import carries_cpu
from .directory import DirectoryCommit, new_token, resolve
from .target import OLD_TAG as OLD_TAG
from .target import TMP_TAG as TMP_TAG
from .target import cwd_inside

log = logging.getLogger("streamload")

PROBE = ".streamload-probe"


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def _global_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank() if group is not None else 0


def _wire_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the agreement's objects travel: the CPU on gloo, the current accelerator otherwise."""
    if group is None or carries_cpu(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _hint(exc: BaseException, parent: Path) -> str | None:
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
            return f"the file system holding {parent} is full: free space there or save to another directory"
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"this process cannot write to {parent}: save to a writable directory"
    if isinstance(exc, KeyboardInterrupt):
        return "the save was interrupted; run it again"
    return None


def _describe(exc: BaseException) -> tuple[str, str | None, int | None]:
    """(reason, hint, rank it names) of ``exc`` in words that pickle (the exception itself may not).

    An error that already names a rank (an agreed ``SaveError`` raised again through ``finish``,
    a ``RemoteRankError`` for another rank's failure) keeps naming that rank and its words.
    """
    if isinstance(exc, SaveError):
        return exc.reason, exc.hint, exc.rank
    text = str(exc)
    reason = f"save failed: {type(exc).__name__}: {text}" if text else f"save failed: {type(exc).__name__}"
    return reason, getattr(exc, "hint", None), getattr(exc, "rank", None)


class Output:
    """One save's temporary directory and the files in it; made by ``open_output``.

    Attributes:
        out_dir: the target directory (absolute).
        tmp_dir: the temporary sibling directory every rank writes into.
        group: the save's process group (None: one process).
        rank: this process's group rank; group rank 0 creates, commits and cleans up.
        global_rank: this process's global rank (named in errors).
        directory: the directory commit group rank 0 runs.
    """

    def __init__(
        self, directory: DirectoryCommit, group: dist.ProcessGroup | None, device: torch.device
    ) -> None:
        self.directory = directory
        self.out_dir = directory.target
        self.tmp_dir = directory.tmp
        self.group = group
        self.device = device
        self.rank = _group_rank(group)
        self.global_rank = _global_rank(group)
        self.fds: dict[str, int] = {}
        self.finished = False
        self.committing = False  # every rank agreed its writes succeeded: rank 0 commits
        self.interrupted: KeyboardInterrupt | None = None  # a deferred Ctrl-C this rank agreed on
        # This process's working directory when it lies in the target: the swap replaces that
        # directory, so the process re-enters the same path, in the new one, after the commit.
        self.cwd = cwd_inside(directory.target)

    # -- agreement ------------------------------------------------------------------

    def agree(self, local: BaseException | None, interruptible: bool = True) -> None:
        """Collective: raises the same ``SaveError`` on every rank when any rank passes an error.

        The first failing rank (lowest group rank) is named; on the failing rank the error is
        chained to its own exception. A Ctrl-C deferred on this rank (``transport.arrival``) is
        its failure here, unless ``interruptible`` is False (after the commit's rename: the
        save is made, and the interrupt is raised on its rank when the call returns).
        """
        if local is None and interruptible and take_interrupt():  # a deferred Ctrl-C
            local = self.interrupted = KeyboardInterrupt()
        mine = None
        if local is not None:
            # A RemoteRankError only says this rank stopped for another's failure: name that one.
            waiting = isinstance(local, RemoteRankError)
            reason, hint, named = _describe(local)
            rank = named if isinstance(named, int) else self.global_rank
            tensor = getattr(local, "tensor", None)  # the tensor a SaveError names (tiling, plan)
            mine = (waiting, rank, reason, hint, _hint(local, self.out_dir.parent), tensor)
        gathered = all_gather_object(mine, self.group, self.device)
        failed = sorted((g for g in gathered if g is not None), key=lambda g: (g[0], g[1]))
        if not failed:
            return
        _waiting, rank, reason, hint, guess, tensor = failed[0]
        err = SaveError(reason, file=str(self.out_dir), rank=rank, hint=hint or guess, tensor=tensor)
        if local is not None and mine == failed[0]:
            raise err from local
        raise err

    # -- files ----------------------------------------------------------------------

    def path(self, name: str) -> Path:
        """The path of output file ``name`` inside the temporary directory."""
        if not name or os.path.isabs(name) or ".." in Path(name).parts:
            raise ValueError(f"output file name must be relative and inside the output: {name!r}")
        return self.tmp_dir / name

    def create_files(self, sizes: dict[str, int]) -> None:
        """Collective: group rank 0 creates each file at its final size; agreed on every rank.

        Args:
            sizes: output file name (relative) -> size in bytes. Every rank passes the same.

        Raises:
            SaveError: on every rank, when any file cannot be created (permission, space).
        """
        local: BaseException | None = None
        if self.rank == 0:
            try:
                for name, size in sizes.items():
                    p = self.path(name)
                    p.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                    try:
                        os.ftruncate(fd, size)
                    finally:
                        os.close(fd)
            except BaseException as exc:  # noqa: BLE001 - agreed below, then raised on every rank
                local = exc
        self.agree(local)

    def open(self, name: str) -> int:
        """A write-only descriptor of output file ``name`` (made by ``create_files``).

        The descriptor belongs to this ``Output``: ``finish`` fsyncs and closes it. Opening
        the same name twice returns the same descriptor.
        """
        fd = self.fds.get(name)
        if fd is None:
            fd = os.open(self.path(name), os.O_WRONLY | os.O_CLOEXEC)
            self.fds[name] = fd
        return fd

    def write_file(self, name: str, data: bytes) -> None:
        """Writes a small whole file (an index, a config) on this rank; ``finish`` fsyncs it."""
        p = self.path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)

    def shared(self) -> bool:
        """Collective: True when every rank provably sees group rank 0's temporary directory.

        Rank 0 writes a probe file holding a random token; every other rank opens it under
        its own path to the directory and reads the token back; a rank on rank 0's host also
        compares the file's (st_dev, st_ino) with rank 0's (device numbers differ per host on
        NFS and Lustre). All ranks agree on the answer. The probe is removed.
        """
        if self.group is None or dist.get_world_size(self.group) == 1:
            return True
        probe = self.tmp_dir / PROBE
        ident: Any = None
        if self.rank == 0:
            token = secrets.token_hex(16)
            try:
                probe.write_text(token)
                st = probe.stat()
                ident = (token, socket.gethostname(), st.st_dev, st.st_ino)
            except OSError as exc:
                ident = None
                log.info("streamload: cannot write the probe file %s: %s", probe, exc)
        ident = broadcast_object(ident, dist.get_global_rank(self.group, 0), self.group, self.device)
        same = False
        if ident is not None:
            try:
                fd = os.open(probe, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    st = os.fstat(fd)
                    token = os.pread(fd, 64, 0).decode()
                finally:
                    os.close(fd)
                # The random token read back proves the file is rank 0's; (st_dev, st_ino) are
                # compared on rank 0's host only (NFS and Lustre number devices per host).
                here = ident[1] == socket.gethostname()
                same = token == ident[0] and (not here or (st.st_dev, st.st_ino) == tuple(ident[2:]))
            except (OSError, UnicodeDecodeError):
                same = False
        verdict = all(all_gather_object(same, self.group, self.device))
        if self.rank == 0:
            try:
                probe.unlink()
            except OSError:
                pass
        return verdict

    # -- commit ---------------------------------------------------------------------

    def _close_fds(self) -> BaseException | None:
        """fsyncs and closes every descriptor ``open`` handed out; the first error, if any."""
        first: BaseException | None = None
        for fd in self.fds.values():
            try:
                os.fsync(fd)
            except OSError as exc:
                first = first or exc
            try:
                os.close(fd)
            except OSError as exc:
                first = first or exc
        self.fds.clear()
        return first

    @property
    def swapped(self) -> bool:
        """Whether the new checkpoint is at ``out_dir`` (set by ``_commit`` on group rank 0)."""
        return self.directory.swapped

    def _commit(self) -> None:
        """On group rank 0: carries the kept entries over, makes the temporary directory durable
        and swaps it into place (``DirectoryCommit.commit``); nothing raises once ``swapped``."""
        self.directory.commit()

    def finish(self, ok: bool = True, error: BaseException | None = None) -> None:
        """Collective: commits the save, or removes it; every rank calls it exactly once.

        Every rank fsyncs and closes its descriptors; the ranks then agree whether all writes
        succeeded. If so, group rank 0 commits the directory (``DirectoryCommit.commit``: the
        existing target's other entries carried over, all but its old weight files; fsynced;
        swapped into place atomically; the replaced directory settled). Otherwise (or if the
        commit fails) the temporary directory is removed and every rank raises the same
        ``SaveError``.

        Args:
            ok: False when this rank's writes failed.
            error: this rank's exception, if any (named in the error every rank raises).

        Raises:
            SaveError: on every rank, when any rank failed; the target is untouched.
            KeyboardInterrupt, SystemExit: re-raised as-is on the rank where they happened,
                after the agreement and the cleanup (the other ranks raise ``SaveError``).
        """
        if self.finished:
            return
        self.finished = True
        local = error if error is not None else (None if ok else SaveError("this rank's writes failed"))
        closed = self._close_fds()
        local = local or closed
        if local is not None and lost_peer(local):
            # A peer is gone: no agreement can complete. Every survivor removes the save's own
            # temporary directory (a random name this save made) and the meeting names the lost rank.
            self.directory.discard()
            raise local
        try:
            self._finish(local)
        except BaseException as exc:
            if lost_peer(exc) and not self.committing:  # lost inside the first agreement below
                self.directory.discard()
            elif lost_peer(exc) and self.rank != 0:
                # Lost while group rank 0 commits: it may have swapped the new checkpoint in. Its
                # temporary directory is its own to remove (removing it here could race its rename);
                # if rank 0 died, the next save to this target removes it (remove_stale).
                raise SaveError(
                    f"a rank was lost while rank 0 committed the save: {self.out_dir} holds the new "
                    "checkpoint if the commit finished, else the previous one (never a mix)",
                    file=str(self.out_dir),
                    rank=getattr(exc, "rank", None),
                    hint=str(exc),
                ) from exc
            raise
        finally:
            self._reenter_cwd()

    def _reenter_cwd(self) -> None:
        if self.cwd is not None:
            try:
                os.chdir(self.cwd)
            except OSError:  # that subdirectory is gone from the new checkpoint: its top
                with contextlib.suppress(OSError):
                    os.chdir(self.out_dir)

    def _finish(self, local: BaseException | None) -> None:
        committed: BaseException | None = None
        try:
            try:
                self.agree(local)
            except SaveError:
                self._discard()
                raise
            self.committing = True
            late: BaseException | None = None
            if self.rank == 0:
                try:
                    self._commit()
                except BaseException as exc:  # noqa: BLE001 - agreed below
                    if self.swapped:
                        # Past the rename the save is committed; what the settling did not finish
                        # stays in the replaced directory (named here), never removed.
                        log.warning(
                            "streamload: saved %s; after the rename: %r (the replaced directory, if any "
                            "is left, is at %s)",
                            self.out_dir,
                            exc,
                            self.directory.aside,
                        )
                        late = exc
                    else:
                        committed = exc
                        self.directory.discard()
            # The rename may have happened: never "not saved" for a Ctrl-C.
            self.agree(committed, interruptible=False)
            if late is not None and not isinstance(late, Exception):
                raise late  # an interrupt stays an interrupt, after the other ranks heard "saved"
        except SaveError:
            if isinstance(local, BaseException) and not isinstance(local, Exception):
                raise local from None
            if committed is not None and not isinstance(committed, Exception):
                raise committed from None  # a Ctrl-C in the commit (one process: none deferred)
            if self.interrupted is not None:  # this rank's Ctrl-C, carried by the agreement
                raise self.interrupted from None
            raise

    def _discard(self) -> None:
        """Collective: group rank 0 removes the temporary directory; every rank waits for it."""
        if self.rank == 0:
            self.directory.discard()
        if self.group is not None and dist.get_world_size(self.group) > 1:
            all_gather_object(None, self.group, self.device)

    def __enter__(self) -> Output:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # An exception in the body is this rank's failure: agree on it and clean up (finish
        # raises the agreed error, chained to it); a clean exit commits.
        self.finish(ok=exc is None, error=exc)


def open_output(
    out_dir: str | os.PathLike, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> Output:
    """Collective: makes the save's temporary sibling directory; returns the ``Output``.

    Group rank 0 draws a random id, broadcasts it (every rank must use the same directory)
    and creates ``<parent>/.<name>.streamload-tmp-<id>`` (the parent is created if missing);
    the result is agreed, so a failure is a ``SaveError`` on every rank.

    Args:
        out_dir: the checkpoint directory the save produces (replaced if it exists).
        group: the save's process group (None: one process, or the default group when
            torch.distributed is initialized).
        device: where the agreements' objects travel (default: CPU for gloo groups, the
            current CUDA device otherwise).

    Returns:
        The ``Output``; call ``finish`` (or use it as a context manager) on every rank.

    Example:
        >>> with open_output("out/model", group) as out:
        ...     out.create_files({"model.safetensors": size})
        ...     os.pwrite(out.open("model.safetensors"), data, offset)
    """
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    wire = device if device is not None else _wire_device(group)
    target = resolve(out_dir)  # as the kernel resolves it: through symlinks
    token = new_token() if _group_rank(group) == 0 else None
    if group is not None and dist.get_world_size(group) > 1:
        token = broadcast_object(token, dist.get_global_rank(group, 0), group, wire)
    assert token is not None
    out = Output(DirectoryCommit(target, token), group, wire)
    local: BaseException | None = None
    if out.rank == 0:
        try:
            out.directory.prepare()
        except BaseException as exc:  # noqa: BLE001 - agreed below
            local = exc
    try:
        out.agree(local)
    except SaveError:
        out.finished = True
        if out.rank == 0:
            out.directory.discard()
        raise
    return out
