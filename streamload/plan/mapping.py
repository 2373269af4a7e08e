"""Caller key mappings (``load_checkpoint(mapping=...)``) as region algebra.

A model whose names are not the checkpoint's (torchtitan's ``tok_embeddings``,
``layers.N.attention.qkv_linear.wqkv``, ``moe.routed_experts.inner_experts.w1_EFD``)
brings its own mapping: a rename callable, or a state-dict adapter in torchtitan's
form (``from_hf_map`` of ``{}`` templates plus ``from_hf``). Renames become identity
pieces; a template whose source has one ``{}`` more than its target (the expert
index) stacks those sources along a new dim 0 in index order, as the adapter's
``torch.stack`` does; module load hooks (fused QKV, ``model/hooks.py``) are applied
on top. Nothing is materialised: every target is pieces of source tensors, and a
mapping that cannot be expressed that way is a ``MappingError``. The adapter's own
``from_hf``, run on meta tensors, must give exactly the names and shapes derived here.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import MappingError, TieError
from ..io.copy_ops import TORCH_DTYPES
from ..model.hooks import apply_load_hooks
from ..model.own_buffers import recomputable
from .adapter_check import check_verified
from .convert import Conversion, Sym, Table, stack
from .regions import identity_piece


@dataclass
class MappedLoad:
    """What a caller mapping gives the load.

    Attributes:
        conversion: target name -> pieces, consumed checkpoint keys, descriptions.
        outside: persistent buffers the mapped format does not hold whose module's class
            overrides ``_init_self_buffers`` (torchtitan's ``moe.expert_bias_E``): kept as
            they are, or recomputed by their module when built on meta (and missing if
            that call does not write them). Any other absent buffer is missing as usual.
    """

    conversion: Conversion
    outside: set[str] = field(default_factory=set)


def _compile(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


def _template_rename(
    from_hf_map: Mapping[str, str | None],
) -> Callable[[str], tuple[str | None, int | None] | None]:
    """hf key -> (model name or None to drop, stacked index or None), or None if unmapped."""
    rules = [(src, _compile(src), dst, src.count("{}")) for src, dst in from_hf_map.items()]

    def rename(key: str) -> tuple[str | None, int | None] | None:
        for src, pattern, dst, n in rules:
            m = pattern.match(key)
            if m is None:
                continue
            if dst is None:
                return None, None
            groups = m.groups()
            k = dst.count("{}")
            if n == k:
                return dst.format(*groups), None
            if n == k + 1:  # the source's last index is stacked (experts of a layer)
                return dst.format(*groups[:k]), int(groups[k])
            raise MappingError(f"template '{src}' -> '{dst}' drops {n - k} indices", tensor=key)
        return None

    return rename


def map_table(
    rename: Callable[[str], tuple[str | None, int | None] | None], table: Table
) -> tuple[dict[str, Sym], set[str], dict[str, set[str]]]:
    """Applies a rename (with stacking) to the tensor table symbolically.

    Args:
        rename: checkpoint key -> (model name or None to drop, stacked index or None),
            or None for a key the mapping does not cover.
        table: the checkpoint's tensor table.

    Returns:
        target -> Sym, the checkpoint keys consumed (dropped ones too), target -> its sources.

    Raises:
        MappingError: two keys onto one target, or stacked indices with gaps.

    Example:
        >>> syms, consumed, sources = map_table(lambda k: (k.replace("model.", ""), None), table)
    """
    plain: dict[str, str] = {}
    stacked: dict[str, dict[int, str]] = {}
    consumed: set[str] = set()
    for key in table:
        got = rename(key)
        if got is None:
            continue  # unmapped: left for match_keys to report as unexpected
        consumed.add(key)
        name, index = got
        if name is None:
            continue
        if index is None:
            if name in plain or name in stacked:
                raise MappingError(f"two checkpoint tensors map to '{name}'", tensor=key)
            plain[name] = key
        else:
            if name in plain or index in stacked.setdefault(name, {}):
                raise MappingError(f"two checkpoint tensors map to '{name}'[{index}]", tensor=key)
            stacked[name][index] = key
    syms: dict[str, Sym] = {}
    sources: dict[str, set[str]] = {}
    for name, key in plain.items():
        shape = tuple(table[key][1])
        syms[name] = Sym(shape, [identity_piece(key, shape)])
        sources[name] = {key}
    for name, by_index in stacked.items():
        indices = sorted(by_index)
        if indices != list(range(len(indices))):
            raise MappingError(
                f"stacked sources have indices {indices}, not 0..{len(indices) - 1}", tensor=name
            )
        keys = [by_index[i] for i in indices]
        leaves = [Sym(tuple(table[k][1]), [identity_piece(k, tuple(table[k][1]))]) for k in keys]
        try:
            syms[name] = stack(leaves, 0)
        except ValueError as exc:
            raise MappingError(f"cannot stack {len(keys)} sources: {exc}", tensor=name) from exc
        sources[name] = set(keys)
    return syms, consumed, sources


def _adapter_shapes(adapter: Any, table: Table) -> dict[str, tuple[int, ...]]:
    """Runs the adapter's own ``from_hf`` on meta tensors: its names and shapes, no bytes."""
    metas = {
        k: torch.empty(shape, dtype=TORCH_DTYPES[dt], device="meta") for k, (dt, shape, _) in table.items()
    }
    try:
        # A copy: from_hf records state (expert bookkeeping) the caller's adapter must not see.
        out = copy.deepcopy(adapter).from_hf(metas)
    except Exception as exc:  # noqa: BLE001 - the adapter's own refusal, reported by name
        raise MappingError(
            f"the adapter's from_hf refused the checkpoint: {type(exc).__name__}: {exc}"
        ) from exc
    return {k: tuple(v.shape) for k, v in out.items()}


def is_adapter(mapping: Any) -> bool:
    """Whether ``mapping`` is a state-dict adapter in torchtitan's form.

    Args:
        mapping: what the caller passed as ``mapping=``.

    Returns:
        True if it has a ``from_hf_map`` mapping and a callable ``from_hf``.

    Example:
        >>> is_adapter(Qwen3StateDictAdapter(cfg, None)), is_adapter({"a": "b"})
        (True, False)
    """
    return isinstance(getattr(mapping, "from_hf_map", None), Mapping) and callable(
        getattr(mapping, "from_hf", None)
    )


def plan_mapping(
    mapping: Any, model: nn.Module, table: Table, targets: Mapping[str, tuple[int, ...]]
) -> MappedLoad:
    """Turns a caller mapping into the load's conversion.

    Args:
        mapping: a torchtitan-style state-dict adapter, a ``{template: name}`` mapping
            (``{}`` for indices; one more ``{}`` in the source stacks it), or a callable
            ``checkpoint key -> model name | None`` (plain renames; None drops the key).
        model: the model (its module load hooks, e.g. fused QKV, are applied).
        table: the checkpoint's tensor table.
        targets: model target name -> global shape.

    Returns:
        The MappedLoad.

    Raises:
        MappingError: the mapping has no exact region form, or an adapter's own
            ``from_hf`` gives other names or shapes than derived here.

    Example:
        >>> plan_mapping(Qwen3StateDictAdapter(cfg, None), model, table, shapes).conversion.pieces.keys()
    """
    adapter = is_adapter(mapping)
    if adapter:
        check_verified(mapping)
        rename = _template_rename(mapping.from_hf_map)
    elif isinstance(mapping, Mapping):
        rename = _template_rename(mapping)
    elif callable(mapping):
        fn = mapping

        def rename(key: str) -> tuple[str | None, int | None] | None:
            return fn(key), None

    else:
        raise MappingError(f"mapping must be an adapter, a dict or a callable, not {type(mapping).__name__}")
    syms, consumed, sources = map_table(rename, table)
    if adapter:
        # Only what the templates map: other tensors are match_keys' unexpected keys (strict, or ignored).
        want = _adapter_shapes(mapping, {k: v for k, v in table.items() if k in consumed})
        got = {k: v.shape for k, v in syms.items()}
        # A tied adapter copies the embedding to lm_head; streamload re-binds the alias instead.
        tied = {k for k in want if k not in got and _is_alias(model, k)}
        untied = sorted(k for k in want if k not in got and k in targets)
        if untied:
            # The adapter ties it (enable_weight_tying), the model holds it as its own parameter
            # (TP's distribute replaces each module's parameter): loading would leave it untied.
            raise TieError(
                f"the adapter ties {untied} to another tensor (enable_weight_tying) but the model "
                "holds them as their own parameters; re-tie before loading, as torchtitan's "
                "init_weights does (model.tok_embeddings.weight = model.lm_head.weight)",
                tensor=untied[0],
            )
        diff = sorted(
            {k for k in set(want) ^ set(got) if k not in tied}
            | {k for k in got if k in want and got[k] != want[k]}
        )
        if diff:
            raise MappingError(
                f"the adapter's from_hf gives {len(want)} tensors, the region form {len(got)}; "
                f"they differ at {diff[:10]}"
            )
    syms, sources = _wrapped_names(model, syms, sources)
    syms, hooked = apply_load_hooks(model, syms)
    for fused, parts in hooked.items():
        sources[fused] = set().union(*(sources.pop(p) for p in parts))
    conv = Conversion(consumed=consumed)
    for name, sym in syms.items():
        if name in targets and tuple(targets[name]) != tuple(sym.shape):
            raise MappingError(
                f"mapped shape {list(sym.shape)}, model shape {list(targets[name])}", tensor=name
            )
        conv.pieces[name] = tuple(sym.pieces)
        conv.described[name] = "mapped" + (" (fused QKV)" if name in hooked else "")
        conv.sources[name] = sources.get(name, set())
    buffers = {f"{n}.{b}" if n else b for n, m in model.named_modules() for b in m._buffers}
    # targets hold only persistent buffers: those the mapped format has no tensor for are exempt
    # only where their module really recomputes them (checked again once it has run).
    outside = recomputable(model, (n for n in targets if n in buffers and n not in syms and n not in table))
    return MappedLoad(conv, outside)


# torch's activation-checkpoint wrapper (torchtitan's AC) puts this in every wrapped name;
# its load pre-hook puts it back into state-dict keys, so mapped names never carry it.
WRAPPED = "_checkpoint_wrapped_module."


def _wrapped_names(
    model: nn.Module, syms: dict[str, Sym], sources: dict[str, set[str]]
) -> tuple[dict[str, Sym], dict[str, set[str]]]:
    """Mapped names as the model names them under an activation-checkpoint wrapper."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    # Every name under a wrapped module without the wrapper's part; others (wq/wk/wv, which
    # only the fused-QKV hook turns into a model name) by their deepest wrapped module.
    real = {n.replace(WRAPPED, ""): n for n in names if WRAPPED in n}
    mods = {m.replace(WRAPPED, ""): m for m, _ in model.named_modules() if WRAPPED in m}

    def model_name(n: str) -> str:
        if n in real:
            return real[n]
        parts = n.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the deepest wrapped module above it
            head = ".".join(parts[:i])
            if head in mods:
                return mods[head] + n[len(head) :]
        return n

    if not real:
        return syms, sources
    return {model_name(n): s for n, s in syms.items()}, {model_name(n): s for n, s in sources.items()}


def _is_alias(model: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` is the same object as a parameter of another name (a tie),
    whichever of the two was registered first."""
    every = dict(model.named_parameters(remove_duplicate=False))
    p = every.get(name)
    return p is not None and any(q is p and n != name for n, q in every.items())
