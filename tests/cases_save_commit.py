"""Multi-rank cases for streamload.save.commit (run by tests/test_save_commit.py in gloo ranks).

Every rank writes its own slice of one shared file (the owners layout in miniature), so a
successful save is checkable byte for byte and a failure injected on one rank must leave
the target as it was on every rank."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from streamload.errors import SaveError
from streamload.save import commit, directory

SLICE = 4096


def payload(rank: int) -> bytes:
    return bytes([rank + 1]) * SLICE


def expected(world: int) -> bytes:
    return b"".join(payload(r) for r in range(world))


def _outcome(fn: Any) -> dict[str, Any]:
    """Runs ``fn``; what it raised, in words the parent can check."""
    try:
        fn()
    except SaveError as exc:
        return {"raised": "SaveError", "rank": exc.rank, "text": str(exc), "cause": repr(exc.__cause__)}
    except BaseException as exc:  # noqa: BLE001 - the interrupt case expects KeyboardInterrupt here
        return {"raised": type(exc).__name__, "text": str(exc)}
    return {"raised": None}


def _save(rank: int, world: int, target: Path, fail: str | None = None, fail_rank: int = -1) -> None:
    """One save of ``world`` slices into ``target/data.bin`` (+ an index on rank 0)."""
    with commit.open_output(target, dist.group.WORLD) as out:
        out.create_files({"data.bin": SLICE * world})
        if rank == 0:
            out.write_file("index.json", b'{"ok": true}')
        if fail == "enospc" and rank == fail_rank:
            real = os.pwrite

            def full(fd: int, data: Any, offset: int) -> int:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            os.pwrite = full  # type: ignore[assignment]
            try:
                os.pwrite(out.open("data.bin"), payload(rank), rank * SLICE)
            finally:
                os.pwrite = real  # type: ignore[assignment]
        if fail == "interrupt" and rank == fail_rank:
            os.pwrite(out.open("data.bin"), payload(rank)[: SLICE // 2], rank * SLICE)
            raise KeyboardInterrupt
        os.pwrite(out.open("data.bin"), payload(rank), rank * SLICE)
        if fail == "fsync" and rank == fail_rank:
            real_fsync = os.fsync

            def broken(fd: int) -> None:
                raise OSError(errno.EIO, os.strerror(errno.EIO))

            os.fsync = broken  # type: ignore[assignment]
            try:
                out.finish()
            finally:
                os.fsync = real_fsync  # type: ignore[assignment]


def case_save(
    rank: int, world: int, target: str, fail: str | None = None, fail_rank: int = -1
) -> dict[str, Any]:
    """A save, optionally failing on ``fail_rank`` (``enospc``: its write; ``fsync``: its fsync;
    ``interrupt``: KeyboardInterrupt mid-write; ``rename``: the commit's exchange on rank 0;
    ``tiny``: nothing injected, the target's file system is what is too small)."""
    real_exchange = directory.rename_exchange
    if fail == "rename" and rank == 0:

        def refuse(src: Any, dst: Any) -> bool:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        directory.rename_exchange = refuse  # type: ignore[assignment]
    if fail == "no-exchange" and rank == 0:
        directory.rename_exchange = lambda src, dst: False  # type: ignore[assignment]
    try:
        return _outcome(lambda: _save(rank, world, Path(target), fail, fail_rank))
    finally:
        directory.rename_exchange = real_exchange  # type: ignore[assignment]


def case_bad_target(rank: int, world: int, target: str) -> dict[str, Any]:
    """The target is a regular file: open_output fails on rank 0, every rank raises."""
    return _outcome(lambda: commit.open_output(target, dist.group.WORLD))


def case_same_tmp(rank: int, world: int, target: str) -> dict[str, Any]:
    """Every rank gets the same temporary directory, and the probe says it is shared."""
    with commit.open_output(target, dist.group.WORLD) as out:
        shared = out.shared()
        tmp = str(out.tmp_dir)
        dist.barrier()  # rank 0 removes the probe as it leaves shared()
        probe_left = (out.tmp_dir / commit.PROBE).exists()
    return {"tmp": tmp, "shared": shared, "probe_left": probe_left}


def case_shared_across_hosts(rank: int, world: int, target: str) -> dict[str, Any]:
    """Ranks 1.. stand for other hosts on a shared file system (NFS, Lustre): their device
    numbers for the same file differ from rank 0's. The token read back proves the sharing."""
    import os as real_os
    from types import SimpleNamespace

    real_fstat, real_host = commit.os.fstat, commit.socket.gethostname
    if rank > 0:
        commit.socket.gethostname = lambda: f"node{rank}"  # type: ignore[assignment]

        def fstat(fd: int) -> Any:
            st = real_fstat(fd)
            return SimpleNamespace(st_dev=st.st_dev + 1000 + rank, st_ino=st.st_ino)

        commit.os.fstat = fstat  # type: ignore[assignment]
    try:
        with commit.open_output(target, dist.group.WORLD) as out:
            shared = out.shared()
    finally:
        commit.os.fstat, commit.socket.gethostname = real_fstat, real_host  # type: ignore[assignment]
    del real_os
    return {"shared": shared}


def case_not_shared(rank: int, world: int, root: str) -> dict[str, Any]:
    """Ranks that each see a different directory under the same name (simulated: rank r
    saves to ``root/r/ckpt`` under a path only it knows) are told the directory is not shared."""
    with commit.open_output(Path(root) / str(rank) / "ckpt", dist.group.WORLD) as out:
        if rank == 0:
            shared = out.shared()
        elif rank == 1:
            # A separate machine: a directory under the same name exists there but is another one.
            out.tmp_dir.mkdir(parents=True, exist_ok=True)
            (out.tmp_dir / commit.PROBE).write_text("another machine's file")
            shared = out.shared()
        else:
            shared = out.shared()  # a machine where the directory does not exist at all
    return {"shared": shared}


def case_save_big(rank: int, world: int, target: str) -> dict[str, Any]:
    """Every rank writes 32 KiB into one file (no injection: a small file system fills up)."""
    big = 32 * 1024

    def run() -> None:
        with commit.open_output(target, dist.group.WORLD) as out:
            out.create_files({"data.bin": big * world})
            os.pwrite(out.open("data.bin"), bytes([rank + 1]) * big, rank * big)

    return _outcome(run)
