"""AReaL's drop-in: ``areal.engine.fsdp_utils.fsdp2_load_full_state_dict``, streamed.

AReaL 1.0.4 (``areal/engine/fsdp_engine.py``, ``FSDPEngine.initialize``) calls
``fsdp2_load_full_state_dict(model, full_state, cpu_offload, tie_word_embeddings=...)``:
``cpu_offload`` third and a tie flag, unlike verl's ``(model, full_state, device_mesh,
cpu_offload)``. This module gives that signature; the work is verl's drop-in's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TieError
from ..io.checkpoint import Checkpoint
from ..model.placement import resolve_device, resolve_group
from ..model.state import record_state
from ..report import LoadReport
from ..transport.arrival import meeting
from ..transport.protocol import gather_or_raise
from .frameworks import fsdp2_load_full_state_dict as _verl_load


def model_mesh(model: nn.Module) -> Any:
    """The device mesh of the model's first DTensor parameter, or None (plain model).

    Clients that take no mesh (AReaL, accelerate) shard over a sub-mesh of the world
    (AReaL's ``dp_sp``): the group to load over is the one the parameters live on.
    """
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return mesh
    return None


def _check_tie_flag(model: nn.Module, tie_word_embeddings: bool, mesh: Any) -> None:
    """TieError on every rank when ``tie_word_embeddings`` says tied but streamload will not tie.

    AReaL calls ``model.tie_weights()`` after loading; streamload ties what the model
    ties by identity or declares (transformers' ``_tied_weights_keys`` under its config),
    the same set ``tie_weights()`` ties. A flag saying tied for a model that neither ties
    nor declares its output embedding to its input embedding would load the head untied:
    an error, agreed before any byte moves.
    """
    error: BaseException | None = None
    try:
        if tie_word_embeddings:
            error = _tie_flag_error(model)
    except Exception as exc:  # noqa: BLE001 - a model's own helper failing: agreed, not a hang
        error = exc
    group = resolve_group(None, mesh)
    if group is None:
        if error is not None:
            raise error
        return
    gather_or_raise(None, error, dist.get_rank(), group, resolve_device(model, mesh, group))


def _tie_flag_error(model: nn.Module) -> TieError | None:
    """The TieError for a model whose output embedding is neither tied nor declared tied."""
    get_emb = getattr(model, "get_input_embeddings", None)
    get_head = getattr(model, "get_output_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    head = get_head() if callable(get_head) else None
    names = {id(m): n for n, m in model.named_modules()}
    if id(emb) not in names or id(head) not in names:
        return None
    emb_name, head_name = f"{names[id(emb)]}.weight", f"{names[id(head)]}.weight"
    if any({emb_name, head_name} <= {g.canonical, *g.aliases} for g in record_state(model).ties):
        return None
    return TieError(
        "tie_word_embeddings=True but the model neither ties nor declares its output "
        f"embedding to '{emb_name}' (config.tie_word_embeddings is "
        f"{getattr(getattr(model, 'config', None), 'tie_word_embeddings', None)})",
        tensor=head_name,
    )


def fsdp2_load_full_state_dict(
    model: nn.Module,
    full_state: Mapping[str, torch.Tensor] | Checkpoint | str | os.PathLike | Any,
    cpu_offload: Any = None,
    tie_word_embeddings: bool = False,
    *,
    timeout: float | None = None,
) -> LoadReport:
    """AReaL's ``fsdp2_load_full_state_dict``, streamed (same signature and effect).

    The model is already sharded by AReaL's ``parallelize_model`` (rank 0 materialised
    on the CPU, the other ranks on meta under ``memory_efficient_load``). Only rank 0's
    ``full_state`` is read. Passing the checkpoint directory (or
    ``streamload.Checkpoint.lazy(path)``) instead of the state dict is the fix for
    per-expert MoE checkpoints: AReaL's rank 0 fills its model with
    ``load_state_dict(raw_checkpoint, strict=False)``, which leaves the fused experts
    (``experts.gate_up_proj`` / ``down_proj``) at their random init with only a warning;
    streamload fuses the per-expert tensors from the files.

    Args:
        model: the ``fully_shard``-ed model.
        full_state: on rank 0, a dict of tensors, a checkpoint path, a
            ``streamload.Checkpoint`` or ``Checkpoint.lazy(path)``; ignored elsewhere.
        cpu_offload: AReaL's ``CPUOffloadPolicy`` or None: when given, parameters end on
            the CPU and buffers on the device.
        tie_word_embeddings: AReaL's flag. Ties are recorded from the model itself (by
            identity and transformers' declarations) and kept on every rank; a flag saying
            tied for a model that neither ties nor declares the head to the embedding is a
            ``TieError`` on every rank before the load.
        timeout: seconds to wait for peers that have not called (see ``load_checkpoint``).

    Returns:
        The LoadReport (AReaL ignores the return value).

    Example:
        >>> from streamload.integrations.areal import fsdp2_load_full_state_dict
        >>> fsdp2_load_full_state_dict(model, config.path if rank == 0 else {}, cpu_offload,
        ...                            tie_word_embeddings=model_config.tie_word_embeddings)
    """
    mesh = model_mesh(model)
    with meeting("areal_fsdp2_load_full_state_dict", resolve_group(None, mesh), timeout):
        _check_tie_flag(model, tie_word_embeddings, mesh)
        return _verl_load(model, full_state, mesh, cpu_offload)
