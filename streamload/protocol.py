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

from .errors import RemoteRankError, StreamloadError
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
    """One-integer all-reduce per bucket: did any rank fail?"""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)

    def any_failed(self, local_failed: bool) -> bool:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return local_failed
        self.flag.fill_(1 if local_failed else 0)
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self.flag.item())
