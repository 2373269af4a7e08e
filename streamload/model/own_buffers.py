"""Buffers a module recomputes itself: torchtitan's ``_init_self_buffers``.

torchtitan modules compute their buffers (RoPE ``cache``, MoE ``tokens_per_expert_E``
and ``expert_bias_E``) in ``_init_self_buffers(buffer_device=...)``, which its
``init_states`` calls after ``to_empty()``. A hub checkpoint holds none of them, so
on a model built on meta they would be uninitialised memory (~1e17 was seen): here
each module whose class really overrides the initialiser recomputes them. Every
torchtitan ``Module`` inherits a no-op ``_init_self_buffers``, so having one proves
nothing: a buffer counts as recomputed only if its module's class overrides the base
method and the call really replaced or wrote the buffer's tensor. A buffer that was a
DTensor gets this rank's part of the recomputed value, with no collective (ranks may
differ in what they reached; a collective here could hang).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import KeyMismatchError
from .state import local_placement, local_tensor

# torchtitan's base no-op (torchtitan/protocols/module.py); tests/test_titan_buffers.py fails
# loudly if torchtitan moves or renames it.
BASE_INIT = "torchtitan.protocols.module.Module._init_self_buffers"


def overrides_init(mod: nn.Module) -> bool:
    """Whether ``mod``'s class has a ``_init_self_buffers`` of its own (not torchtitan's no-op).

    Args:
        mod: a module.

    Returns:
        True if the class (or a base below torchtitan's ``Module``) defines the method.

    Example:
        >>> overrides_init(model.layers[0].attention.rope)  # CosSinRoPE computes its cache
        True
    """
    fn = getattr(type(mod), "_init_self_buffers", None)
    if not callable(fn):
        return False
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}" != BASE_INIT


def recomputable(model: nn.Module, names: Iterable[str]) -> set[str]:
    """The buffers of ``names`` whose module overrides ``_init_self_buffers``.

    Decided before anything is materialised; ``init_own_buffers`` then checks each
    really was written.

    Args:
        model: the model (meta or not).
        names: buffer names.

    Returns:
        The subset whose owning module's class overrides the initialiser.

    Example:
        >>> recomputable(model, ["layers.1.moe.expert_bias_E", "norm.scale"])
        {'layers.1.moe.expert_bias_E'}
    """
    return {n for n in names if overrides_init(model.get_submodule(n.rpartition(".")[0]))}


def _stamp(t: torch.Tensor | None) -> tuple[int, int, int] | None:
    """Identity, storage and version counter: any reassignment or in-place write changes one."""
    if t is None:
        return None
    loc = local_tensor(t)
    return id(t), loc.data_ptr(), loc._version


def _local_part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's shard of ``full`` for ``like``'s placements, cut locally (no collective)."""
    out = torch.empty_like(local_tensor(like), device=full.device, dtype=full.dtype)
    for box, start in local_placement(like).boxes:
        src = full[tuple(slice(a, b) for a, b in box)]
        out[tuple(slice(s, s + (b - a)) for s, (a, b) in zip(start, box, strict=True))] = src
    return out


def _preserving(mod: nn.Module) -> AbstractContextManager[Any]:
    """torchtitan's own save/restore of buffer SPMD annotations around the initialiser."""
    keep = getattr(mod, "_preserve_buffer_spmd_types", None)
    return keep() if callable(keep) else nullcontext()


@torch.no_grad()
def init_own_buffers(model: nn.Module, names: Iterable[str], device: torch.device) -> set[str]:
    """Recomputes buffers ``names`` (after ``to_empty()``) with their module's own initialiser.

    Only modules whose class overrides ``_init_self_buffers`` are called; a buffer
    counts as recomputed only if the call replaced or wrote its tensor (other buffers
    of such a module it wrote are returned too, so the caller can restore values it
    saved before ``to_empty()``). Whatever is not returned is still uninitialised.

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
        if overrides_init(mod):
            by_module[mod_name] = mod
    done: set[str] = set()
    for mod_name, mod in by_module.items():
        kept = dict(mod._buffers)  # alive through the call: a freed tensor's id and storage could be reused
        before = {b: _stamp(t) for b, t in kept.items()}
        placed = {b: t for b, t in mod._buffers.items() if isinstance(t, DTensor)}
        with _preserving(mod):
            mod._init_self_buffers(buffer_device=device)  # type: ignore[operator]
        for b, old in placed.items():
            new = mod._buffers.get(b)
            if new is not None and not isinstance(new, DTensor):
                # As torchtitan's init_states, back to the old placements, but this rank's part only.
                local = _local_part(new, old)
                persistent = b not in mod._non_persistent_buffers_set
                dt = DTensor.from_local(
                    local,
                    old.device_mesh,
                    list(old.placements),
                    run_check=False,
                    shape=old.shape,
                    stride=old.stride(),
                )
                mod.register_buffer(b, dt, persistent=persistent)
        written = {b for b, t in mod._buffers.items() if t is not None and _stamp(t) != before.get(b)}
        done.update(f"{mod_name}.{b}" if mod_name else b for b in written)
        del kept
    return done


def unwritten_is_loud(
    expected: Iterable[str], recomputed: set[str], strict: bool, missing: list[str]
) -> None:
    """Buffers the mapping left to their module that the module did not write: missing, never silent.

    Args:
        expected: the buffers exempted from key matching as recomputed (``MappedLoad.outside``).
        recomputed: what ``init_own_buffers`` really wrote.
        strict: raise rather than report.
        missing: the load's missing keys, extended in place when not strict.

    Raises:
        KeyMismatchError: under ``strict``, naming them.

    Example:
        >>> unwritten_is_loud({"moe.expert_bias_E"}, set(), True, [])  # raises KeyMismatchError
    """
    left = sorted(n for n in expected if n not in recomputed)
    if left and strict:
        raise KeyMismatchError(
            f"{len(left)} missing keys {left[:20]}: not in the checkpoint, and their module's "
            "_init_self_buffers did not write them",
            missing=left,
            unexpected=[],
        )
    missing.extend(n for n in left if n not in missing)
