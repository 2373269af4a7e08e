"""The tie structure each rank handed to FSDP, and the agreement that every rank sharded the same one.

``fully_shard`` records a module's parameters when it runs. A tie alias that is a separate
Parameter at that moment (a model built on meta and not re-tied, e.g. verl's meta init on
ranks >= 1 with the tie guard dropped) becomes its own FSDP parameter: re-binding the attribute
after the load cannot undo that (FSDP installs its own unsharded tensor at every forward), and
ranks that sharded different parameter sets all-gather different sizes at the first forward.
Both are found here from the model as the caller passed it, before anything is materialised,
and raised as a ``TieError`` on every rank before the first weight byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..errors import TieError
from ..transport.collectives import all_gather_object
from .fsdp_rebind import rebound_params
from .state import TieGroup, get_tensor

# How many names an error message lists before it says "..."
_SHOWN = 10


@dataclass(frozen=True)
class TieLayout:
    """What one rank handed to FSDP, in a form cheap to all-gather.

    Attributes:
        digest: a hash of every FSDP-managed parameter's names (all names of one Parameter
            object together) and the ``fully_shard``-ed module that manages it; "" when the
            model has no FSDP module (plain ties are simply re-bound).
        sharded_aliases: (alias, canonical) for each declared tie whose alias is its own FSDP
            parameter on this rank.
    """

    digest: str
    sharded_aliases: tuple[tuple[str, str], ...] = ()


def fsdp_groups(model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """(managing ``fully_shard``-ed module, names of one Parameter object) for every FSDP-managed parameter.

    The manager is the innermost ``FSDPModule`` above the parameter's first name, the module
    whose ``fully_shard`` call took it (an outer one skips parameters an inner one manages).

    Args:
        model: the model, ``fully_shard``-ed or not.

    Returns:
        Sorted entries; empty when no module of ``model`` is an ``FSDPModule``.

    Example:
        >>> fsdp_groups(model)[:1]
        [('', ('lm_head.weight', 'model.embed_tokens.weight'))]
    """
    managers = {name for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    if not managers:
        return []
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    out = []
    for names in by_id.values():
        owner = _manager(names[0], managers)
        if owner is not None:
            out.append((owner, tuple(sorted(names))))
    return sorted(out)


def _manager(name: str, managers: set[str]) -> str | None:
    parts = name.split(".")
    for k in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:k])
        if prefix in managers:
            return prefix
    return None


def tie_layout(model: nn.Module, ties: Sequence[TieGroup]) -> TieLayout:
    """This rank's FSDP parameter sets and the declared ties FSDP manages as two parameters.

    Call it on the model as given, before materialising or re-binding anything.

    Args:
        model: the model the caller passed.
        ties: the tie groups ``record_state`` found (by identity and by declaration).

    Returns:
        The TieLayout to all-gather.

    Example:
        >>> tie_layout(model, record_state(model).ties).sharded_aliases
        (('lm_head.weight', 'model.embed_tokens.weight'),)
    """
    groups = fsdp_groups(model)
    if not groups:
        return TieLayout("")
    managed = {n for _, names in groups for n in names}
    sharded = []
    for g in ties:
        canonical = get_tensor(model, g.canonical)
        for alias in g.aliases:
            held = get_tensor(model, alias)
            if held is not canonical and alias in managed and isinstance(held, DTensor):
                sharded.append((alias, g.canonical))
    sharded += rebound_params(model)  # re-tied after fully_shard: FSDP still holds the old parameter
    digest = hashlib.sha256(repr(groups).encode()).hexdigest()[:32]
    return TieLayout(digest, tuple(sorted(sharded)))


def agree_ties(
    layouts: Sequence[TieLayout],
    model: nn.Module,
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Raises TieError on every rank when a tie alias is its own FSDP parameter on some rank,
    or when ranks sharded different parameter sets; collective only when the digests differ.

    Args:
        layouts: every rank's TieLayout, in group rank order (from the placement all-gather).
        model: this rank's model, as the caller passed it (names the differing parameters).
        rank: this rank's global rank (carried by the error).
        group: the load's group.
        device: the load's device (for the all-gather).

    Example:
        >>> agree_ties(all_gather_object(tie_layout(model, ties)), model, rank, group, device)
    """
    split: dict[tuple[str, str], list[int]] = {}
    for r, lay in enumerate(layouts):
        for pair in lay.sharded_aliases:
            split.setdefault(pair, []).append(r)
    if split:
        (alias, canonical), ranks = next(iter(sorted(split.items())))
        others = [a for a, _ in sorted(split)][1:_SHOWN]
        raise TieError(
            f"tied to '{canonical}', but sharded by fully_shard as its own FSDP parameter on group ranks "
            f"{ranks[:_SHOWN]} of {len(layouts)} (the model was untied when fully_shard ran; call "
            f"model.tie_weights() before sharding). Re-binding it after the load cannot reach FSDP's copy"
            + (f"; also {others}" if others else ""),
            tensor=alias,
            rank=rank,
        )
    if len({lay.digest for lay in layouts}) <= 1:
        return
    # Every rank sees the same digests, so every rank takes part in this second gather.
    everyone = all_gather_object(fsdp_groups(model), group, device)
    differ = [r for r, lay in enumerate(layouts) if lay.digest != layouts[0].digest]
    first = differ[0]
    names = sorted({n for _, ns in set(everyone[first]) ^ set(everyone[0]) for n in ns})
    raise TieError(
        f"ranks handed fully_shard different parameters or tie structures: group ranks {differ[:_SHOWN]} "
        f"differ from rank 0 in {names[:_SHOWN]}{' ...' if len(names) > _SHOWN else ''} "
        "(build and shard the model the same way on every rank)",
        tensor=names[0] if names else None,
        rank=rank,
    )
