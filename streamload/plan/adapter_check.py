"""Which torchtitan state-dict adapters are known to be renames and expert stacking only.

An adapter's ``from_hf`` is accepted as a region map only if it is, byte for byte, one
that was read and verified (tests/test_client_torchtitan.py, bit for bit): keyed on the
torchtitan version and a hash of the source of ``from_hf`` and of every ``self.<method>``
it calls (transitively), each with its defining class. A subclass that overrides any of
them, a patched torchtitan, or another version is a ``MappingError`` naming what changed.
Names and shapes alone cannot tell a value transform: llama3's ``from_hf`` permutes q/k
rows for RoPE with the same names and shapes.
"""

from __future__ import annotations

import hashlib
import inspect
import re
from importlib import metadata
from typing import Any

from ..errors import MappingError

# (from_hf qualname, torchtitan version) -> hash of the sources (``source_digest``).
VERIFIED_FROM_HF: dict[tuple[str, str], str] = {
    (
        "torchtitan.models.qwen3.state_dict_adapter.Qwen3StateDictAdapter.from_hf",
        "0.3.0",
    ): "38b0228744b3d160ee26746a953c2cefd7d556e355e3fa47722f51a352daa4f8",
}

_CALL = re.compile(r"self\.(\w+)\(")


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def called_methods(cls: type) -> dict[str, Any]:
    """``from_hf`` and every method it calls on ``self``, transitively, as resolved on ``cls``.

    Args:
        cls: the adapter's class.

    Returns:
        method name -> the function ``cls`` resolves it to.

    Example:
        >>> sorted(called_methods(Qwen3StateDictAdapter))[:2]
        ['_concatenate_expert_weights', '_concatenate_expert_weights_dtensor']
    """
    found: dict[str, Any] = {}
    todo = ["from_hf"]
    while todo:
        name = todo.pop()
        fn = inspect.getattr_static(cls, name, None)
        fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
        if name in found or not callable(fn):
            continue
        found[name] = fn
        try:
            todo += _CALL.findall(inspect.getsource(fn))
        except (OSError, TypeError):
            found[name] = None  # no source to read: cannot be verified
    return found


def source_digest(cls: type) -> str:
    """sha256 over the defining qualname and source of ``from_hf`` and the methods it calls.

    Args:
        cls: the adapter's class.

    Returns:
        The hex digest.

    Example:
        >>> source_digest(Qwen3StateDictAdapter)[:8]
    """
    h = hashlib.sha256()
    for name, fn in sorted(called_methods(cls).items()):
        src = "" if fn is None else inspect.getsource(fn)
        h.update(f"{name}\0{_qualname(fn)}\0{src}\0".encode())
    return h.hexdigest()


def check_verified(adapter: Any) -> None:
    """Raises unless ``adapter``'s ``from_hf`` (and its helpers) is a verified one.

    Args:
        adapter: a torchtitan-style state-dict adapter.

    Raises:
        MappingError: an unknown ``from_hf``, another torchtitan version, a helper the
            adapter's class overrides, or a changed source.

    Example:
        >>> check_verified(Qwen3StateDictAdapter(cfg, None))  # passes
    """
    cls = type(adapter)
    name = _qualname(getattr(cls, "from_hf", None))
    try:
        version = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        version = "?"
    known = {q for q, _ in VERIFIED_FROM_HF}
    if name not in known:
        raise MappingError(
            f"{name} is not known to be renames and expert stacking only (verified: {sorted(known)}); "
            "a from_hf that also transforms values (llama3 permutes q/k rows) would load wrong with the "
            "same names and shapes. Pass its from_hf_map as a dict if it does nothing more"
        )
    want = VERIFIED_FROM_HF.get((name, version))
    if want is None:
        seen = sorted(v for q, v in VERIFIED_FROM_HF if q == name)
        raise MappingError(f"{name} was verified on torchtitan {seen}, not {version}")
    # The methods the adapter's own class defines (a subclass overriding a verified helper).
    mine = sorted(
        n for n, fn in called_methods(cls).items() if _qualname(fn).split(".")[-2:-1] == [cls.__name__]
    )
    got = source_digest(cls)
    if got != want:
        raise MappingError(
            f"{name} or a method it calls differs from the verified source on torchtitan {version} "
            f"(methods {cls.__name__} itself defines: {mine}); its from_hf is not known to be renames only"
        )
