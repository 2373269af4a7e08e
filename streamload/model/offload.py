"""FSDP2 CPU offload: whether a model keeps its sharded parameters on the CPU, and
materialising a meta model there (parameters on the CPU, buffers on the device)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelMismatchError


def offloads_to_cpu(model: nn.Module) -> bool:
    """True when a ``fully_shard``-ed module of ``model`` has a ``CPUOffloadPolicy``.

    FSDP2 offers no public getter for the policy, so this reads its state
    (``FSDPModule._get_fsdp_state()._fsdp_param_group.offload_policy``);
    tests/test_gpu_path.py fails when torch renames any of it, and a load
    raises ModelMismatchError rather than guess.

    Args:
        model: any module.

    Returns:
        Whether its sharded parameters live on the CPU.

    Example:
        >>> fully_shard(model, offload_policy=CPUOffloadPolicy())
        >>> offloads_to_cpu(model)
        True
    """
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    except ImportError:  # a torch without FSDP2 has no offload either
        return False
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            param_group = module._get_fsdp_state()._fsdp_param_group
            policy = None if param_group is None else param_group.offload_policy
        except AttributeError as exc:
            raise ModelMismatchError(
                f"cannot read FSDP2's offload policy on torch {torch.__version__} ({exc}); "
                "streamload needs updating for this torch"
            ) from exc
        if isinstance(policy, CPUOffloadPolicy):
            return True
    return False


def materialize_offloaded(model: nn.Module, device: torch.device) -> None:
    """Allocates a meta model the way FSDP2 CPU offload keeps it (values are filled by the load).

    Sharded parameters go straight to the CPU (``to_empty`` on the device first
    would allocate every shard there, the memory offload exists to save, and
    FSDP2 refuses offloaded parameters that are not on the CPU); buffers and
    parameters FSDP2 does not manage stay on ``device``, where ``fully_shard``
    put them.

    Args:
        model: a ``fully_shard``-ed model with a ``CPUOffloadPolicy``, on meta.
        device: the accelerator the model computes on.

    Example:
        >>> materialize_offloaded(model, torch.device("cuda", 0))
    """
    model.to_empty(device="cpu")
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = torch.empty_like(buf, device=device)
        for name, param in module._parameters.items():
            if param is not None and not isinstance(param, DTensor) and param.device != device:
                # Ties are re-bound after materialisation (rebind_ties), by name.
                module._parameters[name] = nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=param.requires_grad
                )


def host_targets(tensors: list[torch.Tensor], device: torch.device, offloaded: bool) -> frozenset[int]:
    """Indices of ``tensors`` whose shards live on the host while the load computes on ``device``:
    filled in place from the files, never staged to the device and copied back.

    Those are the shards on the CPU of a load on an accelerator, and the sharded parameters
    (DTensors) of an FSDP2 CPU-offloaded model, which ``materialize_offloaded`` and FSDP2
    keep on the CPU whatever the load's device (buffers and unsharded parameters live on
    the device).

    Args:
        tensors: the load's targets (parameters, buffers) as the model holds them.
        device: the device the load computes on.
        offloaded: whether the model has a ``CPUOffloadPolicy`` (``offloads_to_cpu``).

    Returns:
        The indices of the host-resident targets.

    Example:
        >>> host_targets(tensors, torch.device("cuda", 0), offloads_to_cpu(model))
        frozenset({0, 1, 2})
    """
    from torch.distributed.tensor import DTensor

    out = set()
    for i, t in enumerate(tensors):
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type == "cpu" and (device.type != "cpu" or (offloaded and isinstance(t, DTensor))):
            out.add(i)
    return frozenset(out)
