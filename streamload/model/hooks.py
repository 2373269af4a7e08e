"""Module load hooks as region algebra: torchtitan's fused QKV.

torchtitan's ``FusedQKVLinear`` holds one ``wqkv`` parameter and exposes the stock
``wq`` / ``wk`` / ``wv`` names through state-dict hooks: on load its pre-hook
(``_merge_qkv_on_load``) reshapes each to ``[n_kv, heads, head_dim, ...]`` and
concatenates along the head dim, i.e. ``wqkv`` rows are, per KV group ``g``, the
group's ``heads_per_kv`` query heads, then its key head, then its value head. Here
that interleave is pieces of the three sources (one narrow of each per group), so a
rank's shard of ``wqkv`` is copied from exactly the rows it needs.

What is checked: every entry of every module's ``_load_state_dict_pre_hooks`` is
named (qualname) either the fused-QKV merge, applied here, or one of ``NO_VALUE_HOOKS``,
hooks that change no value: FSDP2's ``to_sharded_hook`` (registered at lazy init, the
first forward; it reshards, and is run here as ``load_state_dict`` would) and the
activation-checkpoint wrapper's prefix hook (its ``_checkpoint_wrapped_module.`` name
part is matched by ``plan/mapping.py``). Any other pre-hook changes names or values in
a way streamload cannot see: a ``MappingError``. So is a ``FusedQKVLinear`` whose merge
hook was not found (a torch rename of the hook dict must not skip the merge silently).
tests/test_titan_hooks.py fails loudly if torch renames the allowed hooks.
"""

from __future__ import annotations

import hashlib
import inspect
from importlib import metadata
from typing import Any

from torch import nn

from ..errors import MappingError
from ..plan.convert import Sym, cat, narrow

FUSED_QKV_HOOK = "FusedQKVLinear._merge_qkv_on_load"
FUSED_QKV_CLASS = "FusedQKVLinear"
TO_SHARDED_HOOK = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"
CHECKPOINT_PREFIX_HOOK = "ActivationWrapper._pre_load_state_dict_hook"
NO_VALUE_HOOKS = frozenset({TO_SHARDED_HOOK, CHECKPOINT_PREFIX_HOOK})


# The fused-QKV merge hook whose interleave ``fused_qkv`` reproduces: (module.qualname, torchtitan
# version) -> sha256 of its source. Another class's override, a patched or another torchtitan is
# a MappingError (the interleave is a value transform: names and shapes cannot check it).
VERIFIED_FUSED_HOOKS: dict[tuple[str, str], str] = {
    (
        "torchtitan.models.common.attention.FusedQKVLinear._merge_qkv_on_load",
        "0.3.0",
    ): "2265fb09b10a3d0aafb12b4d37e59192116cde0859b1eb6d50bb18b7bf2b117b",
}


def check_fused_hook(fn: Any, where: str) -> None:
    """Refuses a fused-QKV load hook that is not, byte for byte, the verified torchtitan one.

    Args:
        fn: the hook function (unwrapped).
        where: the module's name, for the error.

    Raises:
        MappingError: naming the hook and what differs.

    Example:
        >>> check_fused_hook(FusedQKVLinear._merge_qkv_on_load, "layers.0.attention.qkv_linear")
    """
    qualified = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    try:
        version = metadata.version("torchtitan")
        digest = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (metadata.PackageNotFoundError, OSError, TypeError) as exc:
        raise MappingError(f"fused-QKV hook {qualified} cannot be verified: {exc}", tensor=where) from exc
    want = VERIFIED_FUSED_HOOKS.get((qualified, version))
    if want != digest:
        raise MappingError(
            f"fused-QKV hook {qualified} (torchtitan {version}) is not the verified one "
            f"({sorted(VERIFIED_FUSED_HOOKS)}): its interleave has no checked region form",
            tensor=where,
        )


def _hook_name(hook: Any) -> str:
    fn = getattr(hook, "hook", hook)  # torch wraps hooks registered with_module
    return str(getattr(fn, "__qualname__", repr(fn)))


def fused_qkv(q: Sym, k: Sym, v: Sym, head_dim: int, heads_per_kv: int) -> Sym:
    """The fused ``wqkv`` (weight or bias) from ``wq``, ``wk``, ``wv``, as the hook builds it.

    Args:
        q, k, v: the three projections (dim 0: heads x head_dim rows).
        head_dim: rows per head.
        heads_per_kv: query heads per KV head.

    Returns:
        ``cat([q.view(n_kv, hpk, hd, ...), k.view(n_kv, 1, hd, ...), v...], 1).view(-1, ...)`` as pieces.

    Example:
        >>> fused_qkv(q, k, v, 128, 2).shape  # (n_kv * (2 + 2) * 128, dim)
    """
    hd, hpk = head_dim, heads_per_kv
    if k.shape != v.shape or k.shape[0] % hd or q.shape[0] != k.shape[0] * hpk or q.shape[1:] != k.shape[1:]:
        raise MappingError(f"q/k/v shapes {list(q.shape)}, {list(k.shape)}, {list(v.shape)} do not fuse")
    parts: list[Sym] = []
    for g in range(k.shape[0] // hd):
        parts += [narrow(q, 0, g * hpk * hd, hpk * hd), narrow(k, 0, g * hd, hd), narrow(v, 0, g * hd, hd)]
    return cat(parts, 0)


def apply_load_hooks(model: nn.Module, syms: dict[str, Sym]) -> tuple[dict[str, Sym], dict[str, list[str]]]:
    """Applies the model's module load pre-hooks to mapped tensors, symbolically.

    Args:
        model: the model (sharded or not).
        syms: name -> symbolic tensor, as the state dict would hold them.

    Returns:
        The new mapping, and fused name -> the names it was built from.

    Raises:
        MappingError: a load pre-hook that is neither the fused-QKV merge nor in
            ``NO_VALUE_HOOKS``, or a ``FusedQKVLinear`` without its merge hook.

    Example:
        >>> syms, fused = apply_load_hooks(model, syms)
        >>> fused["layers.0.attention.qkv_linear.wqkv.weight"]
        ['layers.0.attention.qkv_linear.wq.weight', ...]
    """
    out = dict(syms)
    fused: dict[str, list[str]] = {}
    merged: set[str] = set()
    for mod_name, mod in model.named_modules():
        for hook in getattr(mod, "_load_state_dict_pre_hooks", {}).values():
            name = _hook_name(hook)
            if name == TO_SHARDED_HOOK:
                getattr(hook, "hook", hook)()  # as load_state_dict: the sharded parameters are loaded
                continue
            if name == CHECKPOINT_PREFIX_HOOK:
                continue
            if not name.endswith(FUSED_QKV_HOOK):
                raise MappingError(f"load_state_dict pre-hook {name} has no region form", tensor=mod_name)
            check_fused_hook(getattr(hook, "hook", hook), mod_name)
            merged.add(mod_name)
            prefix = f"{mod_name}." if mod_name else ""
            for param in ("weight", "bias"):
                keys = [f"{prefix}{w}.{param}" for w in ("wq", "wk", "wv")]
                if not all(k in out for k in keys):
                    if any(k in out for k in keys):
                        raise MappingError(f"fused QKV needs all of {keys}", tensor=mod_name)
                    continue
                q, k, v = (out.pop(key) for key in keys)
                target = f"{prefix}wqkv.{param}"
                out[target] = fused_qkv(q, k, v, int(mod.head_dim), int(mod.heads_per_kv))
                fused[target] = keys
    for mod_name, mod in model.named_modules():
        if any(c.__name__ == FUSED_QKV_CLASS for c in type(mod).__mro__) and mod_name not in merged:
            raise MappingError(
                f"no {FUSED_QKV_HOOK} load hook found on this {FUSED_QKV_CLASS}", tensor=mod_name
            )
    return out, fused
