"""The error protocol: a failure on any rank becomes the same named error on
every rank, promptly, instead of a rank left waiting in a collective.

Before the stream, every rank's result (or its exception) travels in the one
all-gather the plan needs anyway. During the stream, each bucket starts with
a one-integer all-reduce of "did anything fail here"; when it says yes, every
rank drains its in-flight collectives and the exceptions are all-gathered, so
all ranks raise the failing rank's error (file, tensor and rank included).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlacementError, RemoteRankError, StreamloadError
from .arrival import interrupt_pending, lost_peer, take_interrupt, wait_work
from .collectives import all_gather_object, solo

log = logging.getLogger("streamload")


def portable(exc: BaseException, rank: int) -> StreamloadError:
    """``exc`` as a picklable streamload error that carries ``rank``."""
    if isinstance(exc, KeyboardInterrupt):
        return RemoteRankError("interrupted (KeyboardInterrupt)", rank=rank)
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
    """All-gathers ``value`` (or this rank's error) and raises everywhere on any error.

    A Ctrl-C deferred on this rank (``arrival``) is its error here: the peers raise it as a
    named error, this rank raises ``KeyboardInterrupt``."""
    if local is None and take_interrupt():
        local = KeyboardInterrupt()
    if local is not None and lost_peer(local):
        raise local  # no agreement with a peer gone: the call's meeting names it (RankLostError)
    payload = portable(local, rank) if local is not None else value
    gathered = all_gather_object(payload, group, device)
    raise_agreed(local, gathered)
    return gathered


class StatusCheck:
    """One-integer all-reduce per bucket: did any rank fail?

    ``post`` starts the all-reduce without waiting, and its result is read one
    bucket later, so the check never makes the reader wait for the receivers
    to finish unpacking the bucket just sent: the pipeline keeps its overlap.
    On GPUs the flag travels on a CPU-capable group (see ``StatusRoute``):
    reading a device flag would wait for every copy and collective queued
    before it.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.single = solo(group)

    def post(self, local_failed: bool) -> tuple[Any, torch.Tensor]:
        local_failed = local_failed or interrupt_pending()  # a deferred Ctrl-C stops every rank
        flag = torch.full((1,), 1 if local_failed else 0, dtype=torch.int32, device=self.device)
        if self.single:
            return None, flag
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return work, flag

    @staticmethod
    def result(handle: tuple[Any, torch.Tensor]) -> bool:
        work, flag = handle
        wait_work(work, flag.device)
        return bool(flag.item())

    def any_failed(self, local_failed: bool) -> bool:
        return self.result(self.post(local_failed))


def carries_cpu(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) runs collectives on CPU tensors:
    gloo, or a mixed group such as ``"cpu:gloo,cuda:nccl"`` (torch's default backend)."""
    return "gloo" in str(dist.get_backend(group))


def needs_side_group(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True when a load on ``device`` over ``group`` needs a gloo twin for its status flags: an
    accelerator-only group, whatever ``device`` (the flags are CPU tensors; a CPU model's wire
    is the CPU too, see ``open_wire_route``)."""
    return not carries_cpu(group)


@dataclass
class StatusRoute:
    """Where a load's per-bucket status flags travel: ``group``, flags on ``device``.

    ``owned``: the group was created for this load and is destroyed by ``close``.
    """

    group: dist.ProcessGroup | None
    device: torch.device
    owned: bool = False

    def check(self) -> StatusCheck:
        return StatusCheck(self.group, self.device)

    def close(self) -> None:
        """Destroys the side group this route created (every member calls it, after the last flag)."""
        if self.owned and self.group is not None:
            self.owned = False
            dist.destroy_process_group(self.group)


def close_route(route: StatusRoute, what: str = "the load's status group") -> None:
    """``route.close()``; a failure is a warning: the ranks agreed on the call's outcome before
    (raising here on one rank would leave the others waiting in the next agreement), and a
    group left behind costs memory only."""
    try:
        route.close()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        warnings.warn(f"streamload: {what} was not destroyed: {exc}", stacklevel=3)


def open_status_route(
    group: dist.ProcessGroup | None, device: torch.device, create: bool = True
) -> StatusRoute:
    """The route for a load's status flags; collective over the whole world when it creates a group.

    - single process, or a group that carries CPU tensors: that group, flags on the CPU;
    - an accelerator-only group (``"nccl"``) spanning the world: a new gloo group over the
      same ranks, for this load only (``close`` destroys it); every rank of the world takes
      part in the load, so every rank enters this ``new_group`` and torch's group counter
      stays in step;
    - an accelerator-only group over part of the world: the group itself with device flags
      (correct, but each check waits for the device). No group is created there:
      ``new_group`` names groups from a counter that only its callers advance, so a group
      made by a subgroup's members alone leaves the other ranks behind and the next
      world-wide ``new_group`` hangs; ``use_local_synchronization``'s hashed names repeat
      when the same ranks create one again after a ``destroy_process_group`` (its store
      keys are reused) and a member-only group with a name of one's own needs torch's
      private helpers.

    Args:
        group: the load's group.
        device: the load's (wire) device.
        create: False never creates a group (then the third case applies).

    Example:
        >>> route = open_status_route(group, device)
        >>> try:
        ...     status = route.check()
        ... finally:
        ...     route.close()
    """
    if group is None or solo(group) or not needs_side_group(group, device):
        return StatusRoute(group, torch.device("cpu"))
    world = dist.get_world_size(group)
    if create and world == dist.get_world_size():
        ranks = [dist.get_global_rank(group, r) for r in range(world)]
        return StatusRoute(dist.new_group(ranks, backend="gloo"), torch.device("cpu"), owned=True)
    log.info("streamload: status flags on %s (no gloo side group over part of an NCCL world)", device)
    return StatusRoute(group, device)


def open_wire_route(group: dist.ProcessGroup | None, device: torch.device) -> StatusRoute:
    """The group a load's collectives run over when its tensors live on ``device``.

    A model on the CPU (a plain reference model under torchrun) over an accelerator-only group
    (``"nccl"``): NCCL refuses CPU tensors ("No backend type associated with device type cpu",
    on every rank). Such a load runs over a gloo group of the same ranks, made for it alone
    (``close`` destroys it); every other load over ``group`` itself. Collective over the whole
    world when it creates a group (``open_status_route`` says why only then).

    Args:
        group: the load's group.
        device: where the model's tensors live (``resolve_device``).

    Returns:
        The route: ``group`` is the group to load over, ``owned`` whether it was made here.

    Raises:
        PlacementError: a CPU model over an accelerator-only group that spans part of the
            world (no group can be made there safely), on every rank before any collective.

    Example:
        >>> wire = open_wire_route(group, torch.device("cpu"))
        >>> try:
        ...     load_over(wire.group)
        ... finally:
        ...     wire.close()
    """
    if solo(group) or device.type != "cpu" or carries_cpu(group):
        return StatusRoute(group, device)
    assert group is not None
    world = dist.get_world_size(group)
    ranks = [dist.get_global_rank(group, r) for r in range(world)]
    if world != dist.get_world_size():
        raise PlacementError(
            f"the model lives on the CPU but the load's group ({dist.get_backend(group)}, {world} of "
            f"{dist.get_world_size()} ranks) carries no CPU tensors, and no gloo twin of a group over "
            "part of the world can be made without a hang",
            rank=dist.get_rank(),
            hint="pass process_group=dist.new_group(ranks, backend='gloo') (made by every rank), "
            "or move the model to the group's device",
        )
    return StatusRoute(dist.new_group(ranks, backend="gloo"), device, owned=True)
