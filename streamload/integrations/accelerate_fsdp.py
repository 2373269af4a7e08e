"""accelerate's drop-in: ``accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict``, streamed.

``fsdp2_prepare_model`` (``Accelerator.prepare`` with ``FullyShardedDataParallelPlugin(
fsdp_version=2, cpu_ram_efficient_loading=True)``) moves the model to meta, shards it and
calls ``fsdp2_load_full_state_dict(accelerator, model, original_sd, cpu_offload=...)``,
which broadcasts every full tensor to every rank and ``distribute_tensor``-s it there.
The entry here has that signature and sends each rank its own shard only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..model.placement import resolve_group
from ..report import LoadReport
from ..transport.arrival import meeting
from .areal import model_mesh
from .frameworks import fsdp2_load_full_state_dict as _verl_load


def fsdp2_load_full_state_dict(
    accelerator: Any,
    model: nn.Module,
    full_sd: Mapping[str, torch.Tensor] | Any,
    cpu_offload: bool = False,
    *,
    timeout: float | None = None,
) -> LoadReport:
    """accelerate's ``fsdp2_load_full_state_dict``, streamed (same signature and effect).

    Only the main process's ``full_sd`` is read (accelerate's other ranks hold
    ``from_pretrained``'s placeholders there). Parameters keep the dtype accelerate gave
    the sharded model (its fp32 upcast under mixed precision); what accelerate does after
    the call (non-persistent buffers re-registered, ``tie_weights()``) is unchanged.

    Args:
        accelerator: the ``Accelerator`` (its ``is_main_process`` names the reader).
        model: the ``fully_shard``-ed model, on meta.
        full_sd: the main process's full state dict (or a checkpoint path or
            ``streamload.Checkpoint.lazy(path)``); ignored elsewhere.
        cpu_offload: True under ``CPUOffloadPolicy``: parameters end on the CPU.
        timeout: seconds to wait for peers that have not called (see ``load_checkpoint``).

    Returns:
        The LoadReport (accelerate ignores it).

    Example:
        >>> import accelerate.utils.fsdp_utils as fsdp_utils
        >>> import streamload
        >>> fsdp_utils.fsdp2_load_full_state_dict = streamload.accelerate_fsdp2_load_full_state_dict
        >>> model = accelerator.prepare(model)
    """
    # verl's entry reads global rank 0; accelerate's main process is global rank 0 too.
    source = full_sd if getattr(accelerator, "is_main_process", True) else {}
    mesh = model_mesh(model)
    with meeting("accelerate_fsdp2_load_full_state_dict", resolve_group(None, mesh), timeout):
        return _verl_load(model, source, mesh, True if cpu_offload else None)
