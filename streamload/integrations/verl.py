"""verl's FSDP engine beyond the drop-in loader: the ``buffers=`` values of its
``fsdp2_load_full_state_dict`` installed on every rank, and a CPU-offload policy that pins
host memory only where torch can."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DTypeMismatchError, KeyMismatchError, ShapeMismatchError
from ..model.placement import resolve_group
from ..transport.arrival import wait_work
from ..transport.protocol import gather_or_raise


def can_pin_memory() -> bool:
    """Whether ``Tensor.pin_memory()`` works in this process.

    Page-locked host memory is an accelerator's: on a torch without one (a CPU-only build, or no
    device visible) torch raises ``RuntimeError: Cannot access accelerator device when none is
    available`` — from inside ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=True))``,
    verl's hard-coded policy (tests/test_client_verl.py fails when torch changes this).

    Returns:
        True when an accelerator is available.

    Example:
        >>> can_pin_memory()
        False
    """
    return bool(torch.accelerator.is_available())


def offload_policy(pin_memory: bool = True) -> Any:
    """``CPUOffloadPolicy(pin_memory=...)`` that pins only where torch can (see ``can_pin_memory``).

    Pinning changes how fast host-device copies are, never a value, so dropping it on a host
    without an accelerator (where there are no such copies) keeps the load exact.

    Args:
        pin_memory: what the caller asks for (verl: True).

    Returns:
        A ``torch.distributed.fsdp.CPUOffloadPolicy``.

    Example:
        >>> fully_shard(layer, offload_policy=offload_policy())  # verl: CPUOffloadPolicy(pin_memory=True)
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=pin_memory and can_pin_memory())


def agree_buffers(
    model: nn.Module, buffers: Mapping[str, torch.Tensor] | None, device_mesh: Any, device: torch.device
) -> list[str]:
    """Collective: checks rank 0's ``buffers`` against the model before anything is loaded.

    Each name must be a buffer of ``model`` (persistent or not), each value of its shape and dtype;
    else every rank raises the same KeyMismatchError / ShapeMismatchError / DTypeMismatchError.

    Args:
        model: the sharded model (on meta or materialised: only shapes and dtypes are read).
        buffers: on rank 0, name -> value (None or {}: none); ignored elsewhere.
        device_mesh: the model's mesh (its group; default: the default group).
        device: where the all-gather runs.

    Returns:
        The names to install, sorted, the same on every rank.

    Example:
        >>> names = agree_buffers(model, buffers if rank == 0 else None, mesh, torch.device("cpu"))
    """
    group = resolve_group(None, device_mesh)
    rank = dist.get_rank() if group is not None else 0
    names: list[str] = []
    error: BaseException | None = None
    if rank == 0 and buffers:
        try:
            names = _check(model, buffers)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
            error = exc
    gathered = gather_or_raise(names, error, rank, group, device)
    # Global rank 0 holds the values (as verl's loop broadcasts from it); its slot in the
    # group's all-gather is its group rank.
    return list(gathered[dist.get_group_rank(group, 0) if group is not None else 0])


def _check(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> list[str]:
    held = dict(model.named_buffers())
    unknown = sorted(set(buffers) - set(held))
    if unknown:
        raise KeyMismatchError(
            f"buffers= names {len(unknown)} tensors the model holds no buffer for: {unknown[:20]}",
            tensor=unknown[0],
            unexpected=unknown,
        )
    for name in sorted(buffers):
        value, buf = buffers[name], held[name]
        if tuple(value.shape) != tuple(buf.shape):
            raise ShapeMismatchError(
                f"buffers= value has shape {list(value.shape)}, the model's buffer {list(buf.shape)}",
                tensor=name,
            )
        if value.dtype != buf.dtype:
            # A cast could round: a buffer takes the caller's bytes or nothing.
            raise DTypeMismatchError(
                f"buffers= value is {value.dtype}, the model's buffer {buf.dtype}", tensor=name
            )
    return sorted(buffers)


@torch.no_grad()
def install_buffers(
    model: nn.Module, buffers: Mapping[str, torch.Tensor] | None, names: list[str], device_mesh: Any
) -> None:
    """Collective: rank 0's value of every agreed buffer on every rank, broadcast in name order
    (verl broadcasts rank 0's buffers sorted by name: FSDP2 may order ``named_buffers()``
    differently on different ranks, and mismatched sizes in one broadcast hang).

    Args:
        model: the loaded model.
        buffers: rank 0's values (ignored elsewhere).
        names: what ``agree_buffers`` returned.
        device_mesh: the model's mesh.

    Example:
        >>> install_buffers(model, buffers, names, mesh)
    """
    group = resolve_group(None, device_mesh)
    held = dict(model.named_buffers())
    for name in names:
        buf = held[name]
        if group is None or dist.get_rank() == 0:
            assert buffers is not None
            buf.copy_(buffers[name].to(buf.device))
        if group is not None:
            wait_work(dist.broadcast(buf, src=0, group=group, async_op=True), buf.device)
