"""Drop-ins for framework call sites (verl, accelerate, AReaL, torchtitan)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..io.checkpoint import Checkpoint
from ..load.driver import load_checkpoint
from ..model.placement import resolve_device, resolve_group
from ..report import LoadReport
from ..transport.arrival import meeting
from .verl import agree_buffers, install_buffers


def fsdp2_load_full_state_dict(
    model: nn.Module,
    full_state: Mapping[str, torch.Tensor] | Checkpoint | Any,
    device_mesh: Any = None,
    cpu_offload: Any = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    *,
    timeout: float | None = None,
) -> LoadReport:
    """verl's ``fsdp2_load_full_state_dict``, streamed.

    Same signature and effect as ``verl.utils.fsdp_utils.fsdp2_load_full_state_dict``:
    the model is already ``fully_shard``-ed (on meta or materialised); only
    rank 0's ``full_state`` is read (other ranks may pass their meta state
    dict or ``{}``). Unlike the original, receivers never allocate a full
    tensor and rank 0 holds at most the staging ring; buffers are right and
    ties re-bound afterwards.

    Args:
        model: the sharded model.
        full_state: on rank 0, a dict of tensors or a ``streamload.Checkpoint``
            (then rank 0 never materialises the model at all).
        device_mesh: the model's mesh (for the device type and group).
        cpu_offload: as verl: when not None, parameters move to the CPU
            afterwards while buffers stay on the device.
        buffers: newer verl's keyword: on rank 0, buffer name -> value; after the load every
            rank's buffer holds rank 0's value (names, shapes and dtypes are checked on every
            rank before any weight moves; see ``integrations.verl``).
        timeout: seconds to wait for peers that have not called (see ``load_checkpoint``).

    Returns:
        The LoadReport (verl ignores the return value).

    Example:
        >>> fsdp2_load_full_state_dict(model, full_state if rank == 0 else {}, device_mesh)
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    source = full_state if rank == 0 else None
    group = resolve_group(None, device_mesh)
    with meeting("fsdp2_load_full_state_dict", group, timeout):
        wire = resolve_device(model, device_mesh, group)
        names = agree_buffers(model, buffers if rank == 0 else None, device_mesh, wire)
        report = load_checkpoint(model, source, device_mesh=device_mesh, strict=True, progress=False)
        install_buffers(model, buffers, names, device_mesh)
        if cpu_offload is not None:
            offload_parameters(model)
        return report


def offload_parameters(model: nn.Module) -> None:
    """verl's ``cpu_offload`` step: parameters to the CPU, buffers back to their device.

    The moves are asynchronous (``non_blocking``, into pinned memory) and every
    device they left is synchronised before returning: a caller reading the CPU
    parameters right away must see the loaded bytes, not a copy still in flight.
    Parameters FSDP2 already offloaded (``CPUOffloadPolicy``) do not move.

    Args:
        model: the loaded model.

    Example:
        >>> offload_parameters(model)
    """
    held = [t.to_local() if hasattr(t, "to_local") else t for t in (*model.parameters(), *model.buffers())]
    devices = {t.device for t in held if t.device.type not in ("cpu", "meta")}
    device = next((b.device for b in model.buffers()), None)
    model.to("cpu", non_blocking=True)
    if device is not None:
        for buf in model.buffers():
            buf.data = buf.data.to(device, non_blocking=True)
    for d in devices:
        getattr(torch, d.type).synchronize(d)
