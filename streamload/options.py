"""Environment overrides of the load's keywords, read in one place (docs/options.md).

Every option is a keyword of ``load_checkpoint`` / ``from_pretrained``. A few may also be
set from the environment, for launchers that cannot pass keywords. The rule is the same for
each: a keyword left at its default ``None`` is "not given", and only then does its variable
apply; a keyword passed explicitly wins over the environment.
"""

from __future__ import annotations

import functools
import os

# Keyword -> the variable that overrides it when the keyword is not given.
ENV_OVERRIDES: dict[str, str] = {
    "direct_io": "STREAMLOAD_DIRECT_IO",
    "prefault": "STREAMLOAD_PREFAULT",
    "progress": "STREAMLOAD_PROGRESS",
    "node": "STREAMLOAD_NODE",
    "timeout": "STREAMLOAD_TIMEOUT",  # read by transport/arrival.py (a number of seconds)
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(keyword: str, value: bool | None) -> bool | None:
    """A boolean keyword after its environment override: ``value`` when given (not None),
    else its variable (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``, any
    case), else None (the keyword's own default applies).

    Args:
        keyword: a key of ``ENV_OVERRIDES``.
        value: what the caller passed.

    Returns:
        True, False, or None when neither the caller nor the environment said.

    Raises:
        ValueError: the variable holds something else (a typo must not pass for "off").

    Example:
        >>> env_flag("direct_io", None)  # STREAMLOAD_DIRECT_IO=1 -> True; unset -> None
    """
    if value is not None:
        return bool(value)
    name = ENV_OVERRIDES[keyword]
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return None
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 0 or 1 (it overrides the {keyword!r} keyword)")


def env_text(keyword: str, value: str | None) -> str | None:
    """A string keyword after its environment override: ``value`` when given (not None),
    else its variable when set and non-empty, else None.

    Example:
        >>> env_text("node", None)  # STREAMLOAD_NODE=a -> "a"; unset -> None
    """
    if value is not None:
        return value
    raw = os.environ.get(ENV_OVERRIDES[keyword], "").strip()
    return raw or None


# Not a keyword override but a switch for the device check (docs/options.md, "Test hooks"): a
# group of one rank takes the paths of many (the transport's all_to_all and its waits, the side
# group, the object gathers, node mode, the save's src writer), so that one GPU runs streamload's
# NCCL code. NCCL refuses two ranks on one device: without this a one-GPU check runs none of it.
FORCE_MULTI_RANK = "STREAMLOAD_FORCE_MULTI_RANK"


@functools.cache
def force_multi_rank() -> bool:
    """Whether ``STREAMLOAD_FORCE_MULTI_RANK`` is on; read once per process (``cache_clear`` to
    read it again, as tests do).

    Raises:
        ValueError: the variable holds something other than a boolean.

    Example:
        >>> force_multi_rank()  # STREAMLOAD_FORCE_MULTI_RANK=1 -> True; unset -> False
    """
    raw = os.environ.get(FORCE_MULTI_RANK, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in ("", *_FALSE):
        return False
    raise ValueError(f"{FORCE_MULTI_RANK}={os.environ[FORCE_MULTI_RANK]!r}: expected 0 or 1")
