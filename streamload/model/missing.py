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
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import KeyMismatchError
from .hf import unsharded_classes
from .state import get_tensor, local_placement, local_tensor


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


SENTINEL = 0xA5  # every byte of a stand-in before its initialiser runs: one left so was never written


def _stand_in(t: torch.Tensor, device: str, missing: bool) -> torch.Tensor:
    """A plain tensor of ``t``'s global shape and dtype on ``device`` (a Parameter if ``t`` is one):
    what an initialiser sees in place of ``t`` (see ``fill_uncovered``)."""
    if device == "meta":
        plain = torch.empty(t.shape, dtype=t.dtype, device="meta")
    else:
        plain = torch.empty(t.shape, dtype=t.dtype, device=device)
        plain.view(-1).view(torch.uint8).fill_(SENTINEL)
    out = nn.Parameter(plain, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else plain
    out._is_hf_initialized = not missing  # type: ignore[attr-defined]
    return out


@contextlib.contextmanager
def plain_tensors(module: nn.Module, attrs: Iterable[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block ``module`` and its submodules hold plain stand-ins, never a DTensor.

    ``attrs`` (tensors of ``module`` itself) become CPU tensors of their global shape filled with
    ``SENTINEL`` bytes; every other tensor of the subtree becomes a meta tensor, flagged as
    initialised (what an initialiser writes there is dropped: those are streamed, restored or
    initialised in their own module's turn). The original objects are put back on exit.

    Args:
        module: the module about to be initialised.
        attrs: names of its missing parameters and buffers.

    Yields:
        attr -> its CPU stand-in.

    Example:
        >>> with plain_tensors(model.lm_head, ["weight"]) as fresh:
        ...     model._init_weights(model.lm_head)
    """
    wanted = set(attrs)
    slots: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    fresh: dict[str, torch.Tensor] = {}
    try:
        for sub in module.modules():
            tables: list[dict[str, Any]] = [sub._parameters, sub._buffers]
            for table in tables:
                for attr, t in list(table.items()):
                    if t is None:
                        continue
                    slots.append((table, attr, t))
                    missing = sub is module and attr in wanted
                    stand_in = table[attr] = _stand_in(t, "cpu" if missing else "meta", missing)
                    if missing:
                        fresh[attr] = stand_in
        yield fresh
    finally:
        for table, attr, original in reversed(slots):
            table[attr] = original


def _written(now: torch.Tensor, stand_in: torch.Tensor, version: int) -> bool:
    """Whether the initialiser wrote ``stand_in`` (or bound a new tensor in its place): its version
    moved, else (a write through ``.data``) some byte is no longer ``SENTINEL``, looked for a chunk
    at a time (no second tensor of its size)."""
    if now is not stand_in or now._version != version or now.numel() == 0:
        return True
    flat = now.detach().reshape(-1).view(torch.uint8)
    chunk = 16 << 20
    return any(bool((flat[i : i + chunk] != SENTINEL).any()) for i in range(0, flat.numel(), chunk))


def copy_part(target: torch.Tensor, full: torch.Tensor, name: str = "") -> None:
    """Copies this rank's part of ``full`` (the whole tensor, on the CPU) into ``target``'s local shard.

    Example:
        >>> copy_part(model.lm_head.weight, initialised_on_cpu, "lm_head.weight")
    """
    local = local_tensor(target)
    full = full.detach().to(local.dtype)  # any cast on the host, never on the device
    for box, start in local_placement(target, name).boxes:
        src = tuple(slice(lo, hi) for lo, hi in box)
        dst = tuple(slice(s, s + hi - lo) for s, (lo, hi) in zip(start, box, strict=True))
        local[dst].copy_(full[src])


@torch.no_grad()
def fill_uncovered(
    model: nn.Module,
    names: Iterable[str],
    saved: dict[str, torch.Tensor],
    rank: int | None = None,
    seed: int | None = None,
) -> list[str]:
    """After ``to_empty()``: puts ``saved`` back and initialises the rest of ``names``.

    A module holding a meta tensor the file does not fill is initialised by
    transformers' ``_init_weights`` (the nearest one above it) where the model
    has one, else by its own ``reset_parameters``; the module's other tensors
    are either streamed afterwards or restored from ``saved`` right after.

    The initialiser runs on plain CPU tensors of the full shape (``plain_tensors``),
    drawing from the CPU generator seeded with ``seed`` (the caller's generators are
    left as they were), and each rank keeps its part. So no DTensor random op runs:
    on a CUDA mesh the first one would create torch's ``OffsetBasedRNGTracker``, which
    broadcasts an RNG state over the default group (a hang when this load's group is
    part of the world, or one rank fails first). And the values are those of a
    non-sharded init with that seed: the same on every rank, mesh and world size,
    replicas equal. The cost: one module's missing tensors whole on the host at a time.

    Args:
        model: the materialised model.
        names: parameters and persistent buffers the checkpoint does not fill.
        saved: what ``snapshot_real`` kept of them before ``to_empty()``.
        rank: this rank, for the error.
        seed: the same on every rank of the load (the reader's ``torch.initial_seed()``);
            default this process's ``torch.initial_seed()``.

    Returns:
        The names that were initialised (rather than restored).

    Raises:
        KeyMismatchError: a tensor that was on meta, is not in the checkpoint and
            has no initialiser (it would otherwise stay uninitialised memory).

    Example:
        >>> fill_uncovered(model, match_missing, saved, seed=meta.init_seed)
    """
    names = list(names)
    fresh = [n for n in names if n not in saved]
    by_module: dict[str, list[str]] = {}
    for name in fresh:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    stuck: list[str] = []
    seed = torch.initial_seed() if seed is None else seed
    with unsharded_classes(model), _guarded_init(), torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU generator only (fork_rng restores it)
        for mod_name, members in by_module.items():
            module = model.get_submodule(mod_name)
            init = _initializer(model, mod_name)
            reset = getattr(module, "reset_parameters", None)
            if init is None and not callable(reset):
                stuck.extend(members)
                continue
            attrs = [n.rpartition(".")[2] for n in members]
            with plain_tensors(module, attrs) as stand_ins:
                versions = {attr: t._version for attr, t in stand_ins.items()}
                if init is not None:
                    init(module)  # transformers' init skips the tensors flagged as initialised
                else:
                    reset()  # type: ignore[misc]
                now = {attr: get_tensor(module, attr) for attr in attrs}
            # An initialiser that leaves a tensor alone (a no-op reset_parameters, an
            # _init_weights without a branch for it) would leave to_empty's bytes: loud.
            for attr, name in zip(attrs, members, strict=True):
                if not _written(now[attr], stand_ins[attr], versions[attr]):
                    stuck.append(name)
                    continue
                copy_part(get_tensor(model, name), now[attr], name)
            # As transformers leaves them: the module's tensors count as initialised.
            for t in [*module._parameters.values(), *module._buffers.values()]:
                if t is not None:
                    t._is_hf_initialized = True  # type: ignore[attr-defined]
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
