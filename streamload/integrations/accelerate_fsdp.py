"""accelerate's drop-ins: ``accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict``, streamed,
and ``Accelerator.save_model``, written by every rank.

``fsdp2_prepare_model`` (``Accelerator.prepare`` with ``FullyShardedDataParallelPlugin(
fsdp_version=2, cpu_ram_efficient_loading=True)``) moves the model to meta, shards it and
calls ``fsdp2_load_full_state_dict(accelerator, model, original_sd, cpu_offload=...)``,
which broadcasts every full tensor to every rank and ``distribute_tensor``-s it there.
The entry here has that signature and sends each rank its own shard only.

``Accelerator.save_model(model, save_directory, max_shard_size="10GB", safe_serialization=True)``
under FSDP2 gathers ``get_model_state_dict(model, StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True, cpu_offload=True))`` (every full tensor all-gathered, rank 0 keeps a
CPU copy of the whole model), passes it through ``clean_state_dict_for_safetensors`` (which
drops tie aliases only where they still share storage: the gathered CPU copies do not, so a tied
``lm_head.weight`` is written a second time), splits it with huggingface_hub's
``split_torch_state_dict_into_shards`` (by the gathered tensors' sizes, FSDP2's padding
included) and writes the files and the index on the main process: the model's own names (fused
experts stay fused), no config. ``save_model`` here writes the same files with ``save_pretrained(mapping="state_dict")``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..model.placement import resolve_group
from ..report import LoadReport
from ..save.driver import SaveReport, save_pretrained
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


def save_model(
    accelerator: Any,
    model: nn.Module,
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    **kwargs: Any,
) -> SaveReport:
    """accelerate's ``Accelerator.save_model`` under FSDP2, every rank writing its own shards
    (same signature and files; collective over the model's ranks).

    What accelerate writes, byte for byte (tests/test_client_accelerate_save.py): the model's
    own state-dict names and dtypes, every name of a tie (accelerate's gathered copies no longer
    share storage), the files ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` split
    by ``max_shard_size``, ``model.safetensors.index.json`` when split, no config. The split is
    by the tensors' data sizes, so the files do not depend on the rank count; accelerate's counts
    FSDP2's padding and can put a tensor in another file on another rank count (the tensors are
    equal either way).
    No rank gathers a full tensor; the directory's weight files are replaced atomically.

    Args:
        accelerator: the ``Accelerator`` (unused: the ranks are the model's).
        model: the prepared (``fully_shard``-ed) model.
        save_directory: the directory to write (created; other files in it are kept).
        max_shard_size: largest file before splitting, as accelerate's.
        safe_serialization: must be True (streamload writes safetensors only).
        **kwargs: further ``save_pretrained`` options (``writers``, ``bucket_bytes``, ``timeout``).

    Returns:
        The SaveReport of this rank.

    Raises:
        ValueError: ``safe_serialization=False`` (on every rank, before any collective).
        SaveError: on every rank when a write failed; ``save_directory`` is left as it was.

    Example:
        >>> from streamload.integrations.accelerate_fsdp import save_model
        >>> save_model(accelerator, model, "out/step-100")  # was: accelerator.save_model(model, ...)
    """
    if not safe_serialization:
        raise ValueError("streamload writes safetensors only: safe_serialization=False is not supported")
    return save_pretrained(
        model, save_directory, mapping="state_dict", max_shard_size=max_shard_size, **kwargs
    )
