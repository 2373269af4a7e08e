"""Tensors the checkpoint does not cover (``strict=False``): what was real
before the load is kept, what was on meta is initialised, nothing is left as
``to_empty()`` memory.

``to_empty()`` replaces every tensor of a partly-meta model, the real ones
too (accelerate's ``init_empty_weights(include_buffers=False)`` builds
parameters on meta and buffers for real). Tensors the file fills are
overwritten by the stream; the others are snapshotted before and put back
after, or, when they were on meta, initialised the way transformers
initialises missing weights.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..errors import KeyMismatchError
from .hf import unsharded_classes
from .state import get_tensor, local_tensor


def snapshot_real(model: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """CPU clones of the local values of ``names`` that are not on meta.

    Args:
        model: the model, before ``to_empty()``.
        names: parameters and persistent buffers the checkpoint does not fill.

    Returns:
        name -> a clone of this rank's local values (only the uncovered tensors: small).

    Example:
        >>> saved = snapshot_real(model, ["model.extra_bias"])
    """
    out = {}
    for name in names:
        t = local_tensor(get_tensor(model, name))
        if not t.is_meta:
            out[name] = t.detach().to("cpu", copy=True)
    return out


def _initializer(model: nn.Module, mod_name: str) -> Callable[[nn.Module], Any] | None:
    """The nearest ``_init_weights`` at or above ``mod_name`` (a composite
    model's sub-models initialise their own modules, as transformers does)."""
    parts = mod_name.split(".") if mod_name else []
    for cut in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:cut]))
        init = getattr(owner, "_init_weights", None)
        if callable(init):
            return init  # type: ignore[no-any-return]
    return None


def _guarded_init() -> contextlib.AbstractContextManager[Any]:
    """transformers' guard that makes ``torch.nn.init`` respect ``_is_hf_initialized`` too."""
    if "transformers" not in sys.modules:
        return contextlib.nullcontext()  # no transformers model here: do not import it (seconds)
    try:
        from transformers import initialization as hf_init
    except ImportError:
        return contextlib.nullcontext()
    return hf_init.guard_torch_init_functions()  # type: ignore[no-any-return]


def _stamp(t: torch.Tensor) -> tuple[int, int, int, int]:
    """Identity, version, and the local part's storage and version: any write or re-binding
    changes one (an in-place write to a DTensor bumps the wrapper's version counter)."""
    loc = local_tensor(t)
    return id(t), t._version, loc.data_ptr(), loc._version


@torch.no_grad()
def fill_uncovered(
    model: nn.Module, names: Iterable[str], saved: dict[str, torch.Tensor], rank: int | None = None
) -> list[str]:
    """After ``to_empty()``: puts ``saved`` back and initialises the rest of ``names``.

    A module holding a meta tensor the file does not fill is initialised by
    transformers' ``_init_weights`` (the nearest one above it) where the model
    has one, else by its own ``reset_parameters``; the module's other tensors
    are either streamed afterwards or restored from ``saved`` right after.

    Args:
        model: the materialised model.
        names: parameters and persistent buffers the checkpoint does not fill.
        saved: what ``snapshot_real`` kept of them before ``to_empty()``.
        rank: this rank, for the error.

    Returns:
        The names that were initialised (rather than restored).

    Raises:
        KeyMismatchError: a tensor that was on meta, is not in the checkpoint and
            has no initialiser (it would otherwise stay uninitialised memory).

    Example:
        >>> fill_uncovered(model, match_missing, saved)
    """
    names = list(names)
    fresh = [n for n in names if n not in saved]
    by_module: dict[str, list[str]] = {}
    for name in fresh:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    stuck: list[str] = []
    with unsharded_classes(model), _guarded_init():
        for mod_name, members in by_module.items():
            module = model.get_submodule(mod_name)
            init = _initializer(model, mod_name)
            reset = getattr(module, "reset_parameters", None)
            # An initialiser that leaves a tensor alone (a no-op reset_parameters, an
            # _init_weights without a branch for it) leaves to_empty's bytes: loud.
            before = {n: _stamp(get_tensor(model, n)) for n in members}
            if init is not None:
                # transformers' init skips tensors flagged as initialised: flag this module's
                # other tensors (streamed or restored afterwards), unflag the missing ones.
                attrs = {n.rpartition(".")[2] for n in members}
                for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                    if t is not None:
                        t._is_hf_initialized = attr not in attrs  # type: ignore[attr-defined]
                init(module)
                for attr in attrs:
                    get_tensor(module, attr)._is_hf_initialized = True  # type: ignore[attr-defined]
            elif callable(reset):
                reset()
            else:
                stuck.extend(members)
                continue
            stuck.extend(n for n in members if _stamp(get_tensor(model, n)) == before[n])
    if stuck:
        raise KeyMismatchError(
            f"{len(stuck)} tensors built on meta are not in the checkpoint and no initialiser wrote them "
            f"(no _init_weights or reset_parameters, or one that left them alone): {stuck[:20]}; "
            "they would be uninitialised memory",
            rank=rank,
            missing=stuck,
        )
    for name, value in saved.items():
        local_tensor(get_tensor(model, name)).copy_(value)
    return fresh
