"""Checkpoint keys -> model targets: which source regions fill each tensor,
and which keys are missing or unexpected."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .model_state import ModelState
from .plan import Target
from .regions import SourcePiece, identity_piece

# key -> (dtype, shape, file)
Table = dict[str, tuple[str, tuple[int, ...], str]]
# A converter builds pieces for a model name from the table, or returns None.
Converter = Callable[[str, tuple[int, ...], Table], "tuple[SourcePiece, ...] | None"]


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
    converters: list[tuple[str, Converter]] | None = None,
) -> KeyMatch:
    """Builds the targets and the key report.

    Args:
        state: the recorded model state (canonical params, persistent buffers, ties).
        shapes: global shape of every target name.
        table: the checkpoint's tensor table.
        ignore_missing / ignore_unexpected: transformers' ignore regexes.
        converters: (description, function) pairs tried for names not in the
            checkpoint as they are (e.g. fused MoE experts).

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
        else:
            for desc, conv in converters or []:
                pieces = conv(name, shape, table)
                if pieces is not None:
                    converted[name] = desc
                    break
        if pieces is None:
            if ignore_missing is None or ignore_missing.search(name) is None:
                missing.append(name)
            continue
        used.update(p.key for p in pieces)
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
