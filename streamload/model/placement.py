"""Where a model's shards live: the process group a load or save runs over (``resolve_group``,
a group over an N-d mesh's ranks made by them alone: ``mesh_group``) and the device its
collectives and device-resident tensors use (``resolve_device``). Below both drivers."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .state import fsdp_device, local_tensor


def resolve_group(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup | None:
    """The group to load over: given, else the default one; None without torch.distributed."""
    if process_group is not None:
        return process_group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if device_mesh is not None:
        if device_mesh.ndim == 1:
            return device_mesh.get_group()
        if device_mesh.size() != dist.get_world_size():
            return mesh_group(device_mesh)
    return dist.group.WORLD


# Groups over N-d meshes' ranks, made once per (ranks, backend) and kept for the process's life.
_MESH_GROUPS: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}


def mesh_group(device_mesh: Any) -> dist.ProcessGroup:
    """A group over every rank of an N-d mesh that covers part of the world (``mesh["dp", "tp"]``
    of one pipeline stage), created by its members alone.

    Not ``device_mesh._flatten()``: that calls ``new_group``, which every rank of the world must
    call (torch names groups from a counter only its callers advance); called by one stage's
    ranks, the next world-wide ``new_group`` hangs. ``use_local_synchronization=True`` names the
    group by a hash of its ranks and advances no counter; the group is kept (never destroyed),
    so the hash is never reused for another group of the same ranks.
    """
    ranks = tuple(sorted(int(r) for r in device_mesh.mesh.flatten().tolist()))
    backend = str(dist.get_backend(device_mesh.get_group(0)))
    key = (ranks, backend)
    if key in _MESH_GROUPS:
        try:
            dist.get_world_size(_MESH_GROUPS[key])
        except (KeyError, RuntimeError, ValueError):  # destroyed (destroy_process_group, a re-init)
            del _MESH_GROUPS[key]
    if key not in _MESH_GROUPS:
        group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
        assert group is not None  # this rank is one of ``ranks``
        _MESH_GROUPS[key] = group
    return _MESH_GROUPS[key]


def resolve_device(model: nn.Module, device_mesh: Any, group: dist.ProcessGroup | None) -> torch.device:
    """The device collectives and device-resident tensors use.

    Its type comes from the mesh, else the model's parameters, else the backend. Its index
    (never blindly ``current_device()``, which is 0 when the caller never called
    ``set_device``) comes from a tensor the model already holds on that device, else the
    group's bound device (``init_process_group(device_id=...)``), else the device
    ``fully_shard`` recorded (``fsdp_device``), else the current device. A meta model is
    materialised on it only where it is the recorded one (``check_fsdp_device``).
    """
    dev_type = getattr(device_mesh, "device_type", None)
    if dev_type is None:
        for p in model.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                dev_type = mesh.device_type
                break
            if not p.is_meta:
                dev_type = p.device.type
                break
    if dev_type is None:
        backend = dist.get_backend(group) if group is not None else "gloo"
        dev_type = "cuda" if "nccl" in str(backend) else "cpu"
    if dev_type == "cpu":
        return torch.device("cpu")
    for t in itertools.chain(model.parameters(), model.buffers()):
        held = local_tensor(t).device
        if held.type == dev_type:
            return held
    for g in (group, dist.group.WORLD if dist.is_available() and dist.is_initialized() else None):
        bound = getattr(g, "bound_device_id", None)
        if isinstance(bound, torch.device) and bound.type == dev_type:
            return bound  # collectives must run there; a different recorded device is refused later
    recorded = fsdp_device(model)
    if recorded is not None and recorded.type == dev_type:
        return recorded  # where FSDP2 all-gathers, whatever is current now
    return torch.device(dev_type, getattr(torch, dev_type).current_device())
