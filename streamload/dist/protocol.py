"""The error protocol: a failure on any rank becomes the same named error on
every rank, promptly, instead of a rank left waiting in a collective.

Before the stream, every rank's result (or its exception) travels in the one
all-gather the plan needs anyway. During the stream, each bucket starts with
a one-integer all-reduce of "did anything fail here"; when it says yes, every
rank drains its in-flight collectives and the exceptions are all-gathered, so
all ranks raise the failing rank's error (file, tensor and rank included).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import RemoteRankError, StreamloadError
from .transport import all_gather_object


def portable(exc: BaseException, rank: int) -> StreamloadError:
    """``exc`` as a picklable streamload error that carries ``rank``."""
    if isinstance(exc, StreamloadError):
        if exc.rank is None:
            exc.rank = rank
        return exc
    err = RemoteRankError(f"{type(exc).__name__}: {exc}", rank=rank)
    err.__cause__ = exc
    return err


def raise_agreed(local: BaseException | None, gathered: list[Any]) -> None:
    """Raises on every rank when any gathered entry is an error.

    The failing rank re-raises its own exception; the others raise the first
    failing rank's error (same class, with its file, tensor and rank).
    """
    failures = [g for g in gathered if isinstance(g, BaseException)]
    if local is not None:
        raise local
    if failures:
        raise failures[0]


def gather_or_raise(
    value: Any, local: BaseException | None, rank: int, group: dist.ProcessGroup | None, device: torch.device
) -> list[Any]:
    """All-gathers ``value`` (or this rank's error) and raises everywhere on any error."""
    payload = portable(local, rank) if local is not None else value
    gathered = all_gather_object(payload, group, device)
    raise_agreed(local, gathered)
    return gathered


class StatusCheck:
    """One-integer all-reduce per bucket: did any rank fail?

    ``post`` starts the all-reduce without waiting, and its result is read one
    bucket later, so the check never makes the reader wait for the receivers
    to finish unpacking the bucket just sent: the pipeline keeps its overlap.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.single = group is None or dist.get_world_size(group) == 1

    def post(self, local_failed: bool) -> tuple[Any, torch.Tensor]:
        flag = torch.full((1,), 1 if local_failed else 0, dtype=torch.int32, device=self.device)
        if self.single:
            return None, flag
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return work, flag

    @staticmethod
    def result(handle: tuple[Any, torch.Tensor]) -> bool:
        work, flag = handle
        if work is not None:
            work.wait()
        return bool(flag.item())

    def any_failed(self, local_failed: bool) -> bool:
        return self.result(self.post(local_failed))
