"""Checkpoint keys -> model targets: which source regions fill each tensor,
and which keys are missing or unexpected."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..model.state import ModelState
from .buckets import Target
from .convert import Conversion, Table
from .regions import SourcePiece, identity_piece


@dataclass
class KeyMatch:
    """The outcome of matching model targets to checkpoint keys."""

    targets: list[Target]
    missing: list[str]
    unexpected: list[str]
    tie_duplicates: list[tuple[str, str]] = field(
        default_factory=list
    )  # (canonical key, alias key) both in file
    converted: dict[str, str] = field(default_factory=dict)  # target -> how it was built


def match_keys(
    state: ModelState,
    shapes: dict[str, tuple[int, ...]],
    table: Table,
    ignore_missing: re.Pattern[str] | None = None,
    ignore_unexpected: re.Pattern[str] | None = None,
    conversion: Conversion | None = None,
) -> KeyMatch:
    """Builds the targets and the key report.

    Args:
        state: the recorded model state (canonical params, persistent buffers, ties).
        shapes: global shape of every target name.
        table: the checkpoint's tensor table.
        ignore_missing / ignore_unexpected: transformers' ignore regexes.
        conversion: renamed and converted targets (e.g. fused MoE experts),
            used for names not in the checkpoint as they are.

    Returns:
        The targets in model order, plus missing and unexpected keys.
    """
    aliases_of = {g.canonical: g.aliases for g in state.ties}
    used: set[str] = set()
    targets: list[Target] = []
    missing: list[str] = []
    dups: list[tuple[str, str]] = []
    converted: dict[str, str] = {}
    for name in state.targets():
        shape = shapes[name]
        key = name if name in table else next((a for a in aliases_of.get(name, []) if a in table), None)
        pieces: tuple[SourcePiece, ...] | None = None
        if key is not None:
            pieces = (identity_piece(key, table[key][1]),)
        elif conversion is not None and name in conversion.pieces:
            pieces = conversion.pieces[name]
            converted[name] = conversion.described.get(name, "converted")
        if pieces is None:
            if ignore_missing is None or ignore_missing.search(name) is None:
                missing.append(name)
            continue
        used.update(p.key for p in pieces)
        if conversion is not None:
            used.update(conversion.sources.get(name, ()))
        for alias in aliases_of.get(name, []):
            if alias in table and alias != key:
                used.add(alias)
                dups.append((key or name, alias))
        targets.append(Target(name, tuple(shape), pieces))
    unexpected = [
        k
        for k in table
        if k not in used and (ignore_unexpected is None or ignore_unexpected.search(k) is None)
    ]
    return KeyMatch(targets, missing, unexpected, dups, converted)
