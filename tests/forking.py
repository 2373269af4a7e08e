"""Waiting for a forked child in tests: a hang is a failure, never a stuck test run."""

from __future__ import annotations

import os
import signal
import time


def wait_for_child(pid: int, seconds: float, hang: str) -> None:
    """Waits up to ``seconds`` for child ``pid``; kills it and fails with ``hang`` if it
    does not finish, and asserts it exited with status 0."""
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(hang)
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
