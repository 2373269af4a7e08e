"""A checkpoint read before ``os.fork()`` reads in the child, in every read mode.

The cold engine reads on helper threads (``io/readahead.py``'s pool, the native
ColdReader's): a child of ``fork`` has none of them, and a read queued on the
parent's pool never runs there. Each test forks with a deadline, so a hang is a
failure, and compares the child's bytes with the parent's, and the parent's
after the fork with its own before.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from forking import wait_for_child

from streamload.io.checkpoint import Checkpoint
from streamload.io.readahead import ReadAhead
from streamload.tools.synthetic import make_checkpoint

DEADLINE = 30.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("fork") / "ckpt",
        "qwen2",
        layers=2,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_shard_size="8KB",
    )


def _digest(c: Checkpoint) -> str:
    """sha256 over every tensor's bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(c.keys()):
        h.update(name.encode())
        h.update(c.read(name).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _read_in_child(c: Checkpoint) -> str:
    """Forks; the child reads every tensor and writes its digest to a pipe. A child that
    does not answer within DEADLINE is killed and the test fails."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.write(w, _digest(c).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        wait_for_child(pid, DEADLINE, "the child hung reading a Checkpoint used before fork()")
        return os.read(r, 256).decode()
    finally:
        os.close(r)


@pytest.mark.parametrize("mode", ["cold", "mmap", "pread"])
def test_checkpoint_read_before_fork_reads_in_child(ckpt: Path, mode: str) -> None:
    c = Checkpoint(ckpt, mode=mode, threads=2)
    assert c.read_mode == mode
    before = _digest(c)  # starts the helper threads the child will not have
    assert _read_in_child(c) == before
    assert _digest(c) == before  # the parent's threads still serve it
    assert _read_in_child(c) == before  # and a second fork, from a parent that forked once


def test_cold_direct_io_read_before_fork(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT lanes (several native threads each; buffered where the file system refuses)."""
    monkeypatch.setenv("STREAMLOAD_DIRECT_IO", "1")
    c = Checkpoint(ckpt, mode="cold", threads=4)
    before = _digest(c)
    assert _read_in_child(c) == before
    assert _digest(c) == before


def _mp_child(c: Checkpoint, out: mp.Queue) -> None:
    out.put(_digest(c))


def test_cold_read_before_multiprocessing_fork(ckpt: Path) -> None:
    """multiprocessing's 'fork' start method (a DataLoader worker's) inherits the open checkpoint."""
    c = Checkpoint(ckpt, mode="cold")
    before = _digest(c)
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_mp_child, args=(c, out), daemon=True)
    p.start()
    try:
        got = out.get(timeout=DEADLINE)
    except Exception:  # queue.Empty: the child hung
        p.kill()
        raise AssertionError("the multiprocessing child hung reading a cold Checkpoint") from None
    finally:
        p.join(timeout=DEADLINE)
    assert got == before and p.exitcode == 0
    assert _digest(c) == before


def test_readahead_read_in_flight_at_fork_is_forgotten_in_child() -> None:
    """A read still running on the parent's helper thread at fork time never completes in
    the child: the child's next batch must not wait for it."""
    release = threading.Event()
    started = threading.Event()

    def read(rows: np.ndarray, which: int) -> int:
        if int(rows[0]) == 0:
            started.set()
            release.wait()  # the parent's first read blocks until after the fork
        return int(rows[0]) * 10 + which

    ahead: ReadAhead[int] = ReadAhead(read, buffers=2)
    ahead.announce(np.array([0]), [np.array([0])])
    assert started.wait(DEADLINE)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            batch = ahead.start(np.array([7]), [np.array([7]), np.array([8])])
            got = [ahead.wait(batch, i) for i in range(len(batch.chunks))]
            os.write(w, repr(got).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    release.set()
    try:
        wait_for_child(pid, DEADLINE, "the child waited for a read in flight in its parent")
        got = os.read(r, 256).decode()
    finally:
        os.close(r)
    assert got == "[70, 81]", got  # buffers 0 then 1: every buffer free again in the child
    # The parent's own read completes as usual.
    batch = ahead.start(np.array([0]), [])
    assert ahead.wait(batch, 0) == 0  # chunk 0 read into buffer 0
    ahead.done(batch, 0)
    ahead.close()


def test_native_cold_reader_pool_survives_fork(tmp_path: Path) -> None:
    """The native ColdReader's thread pool (csrc/thread_pool.cpp resets every pool in a fork
    child): a reader used with several threads before fork() reads in the child too."""
    from streamload.io import _native

    f = tmp_path / "blob.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes())
    reader = _native.ColdReader(threads=4, block_bytes=4096)
    spans = np.ascontiguousarray(np.array([[0, 1 << 20]], dtype=np.int64))

    def prefetch() -> int:
        return int(reader.prefetch(str(f), spans.ctypes.data, spans.nbytes)["bytes_read"])

    assert prefetch() == 1 << 20  # the pool's threads have run
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.write(w, str(prefetch()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        wait_for_child(pid, DEADLINE, "the native ColdReader's pool hung in a fork child")
        got = os.read(r, 64).decode()
    finally:
        os.close(r)
    assert got == str(1 << 20)
    assert prefetch() == 1 << 20
