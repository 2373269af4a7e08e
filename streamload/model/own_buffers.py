"""Buffers a module recomputes itself: torchtitan's ``_init_self_buffers``.

torchtitan modules compute their buffers (RoPE ``cache``, MoE ``tokens_per_expert_E``
and ``expert_bias_E``) in ``_init_self_buffers(buffer_device=...)``, which its
``init_states`` calls after ``to_empty()``. A hub checkpoint holds none of them, so
on a model built on meta they would be uninitialised memory (~1e17 was seen): here
each module that owns such a buffer recomputes it, with torchtitan's own DTensor
handling (a buffer that was a DTensor is distributed back to its placements).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def init_own_buffers(model: nn.Module, names: Iterable[str], device: torch.device) -> set[str]:
    """Recomputes buffers ``names`` (after ``to_empty()``) with their module's own initialiser.

    Only modules with a callable ``_init_self_buffers`` are visited; their other
    buffers are recomputed too (the initialiser writes them all) and are returned, so
    the caller can restore values it saved before ``to_empty()`` afterwards.

    Args:
        model: the materialised model.
        names: buffer names that were on meta.
        device: where the buffers live.

    Returns:
        Every buffer name that was recomputed.

    Example:
        >>> init_own_buffers(model, ["layers.0.attention.rope.cache"], torch.device("cpu"))
        {'layers.0.attention.rope.cache'}
    """
    by_module: dict[str, nn.Module] = {}
    for name in names:
        mod_name = name.rpartition(".")[0]
        mod = model.get_submodule(mod_name)
        if callable(getattr(mod, "_init_self_buffers", None)):
            by_module[mod_name] = mod
    done: set[str] = set()
    for mod_name, mod in by_module.items():
        placed = {b: (t.device_mesh, t.placements) for b, t in mod._buffers.items() if isinstance(t, DTensor)}
        mod._init_self_buffers(buffer_device=device)  # type: ignore[operator]
        for b, (mesh, placements) in placed.items():
            new = mod._buffers.get(b)
            if new is not None and not isinstance(new, DTensor):
                persistent = b not in mod._non_persistent_buffers_set
                mod.register_buffer(b, distribute_tensor(new, mesh, list(placements)), persistent=persistent)
        done.update(f"{mod_name}.{b}" if mod_name else b for b, t in mod._buffers.items() if t is not None)
    return done
