"""A save under a caller mapping: the output names are not transformers' but the mapping's.

``save_pretrained(model, out, mapping=...)`` takes two forms:

- a state-dict adapter in torchtitan's form (``to_hf`` and ``from_hf`` with ``from_hf_map``):
  the hub names and shapes are the adapter's own ``to_hf`` run on meta tensors of the
  model's state dict as torchtitan's ``ModelWrapper.state_dict()`` gives it (the fused QKV
  split into ``wq/wk/wv`` shapes, the activation-checkpoint wrapper's name part removed);
  the bytes are the load's region map (``plan.mapping.plan_mapping``: renames, per-expert
  stacking, the fused-QKV interleave) run backwards: every hub tensor is written from the
  pieces of the model tensors the load would fill from it. The load's checks hold as they
  are (a verified ``from_hf``, its meta run agreeing with the region form, the verified
  merge hook), so a ``to_hf`` the load cannot invert is a ``MappingError``;
- ``"state_dict"``: the model's own ``state_dict()`` names and shapes, no conversion (fused
  experts stay fused), every name of a tie written (accelerate's FSDP2 gather copies each
  alias to the CPU on its own, so ``clean_state_dict_for_safetensors`` sees no shared storage
  and keeps both), weights only: what ``Accelerator.save_model`` writes under FSDP2.

A model tensor with no output tensor is refused by name (parameters) or left out as the
mapping leaves it out (buffers: torchtitan's ``expert_bias_E``, ``tokens_per_expert_E``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..errors import MappingError
from ..plan.adapter_check import check_verified
from ..plan.mapping import WRAPPED, is_adapter, plan_mapping
from ..plan.regions import SourcePiece, identity_piece
from .layout import Layout, layout_of, out_dtype
from .plan import _check_once

STATE_DICT = "state_dict"
MAPPINGS = (STATE_DICT,)

# State-dict hooks whose effect the adapter form accounts for (the fused-QKV split) or
# that change no name, shape or value of what is saved (FSDP2's own).
_SPLIT_QKV = "FusedQKVLinear._split_qkv_on_save"
_QKV_CLASS = "FusedQKVLinear"


def describe(mapping: Any) -> str | None:
    """What ranks agree on for ``mapping`` (its kind and class), None without one.

    Example:
        >>> describe(Qwen3StateDictAdapter(cfg, None))
        'adapter:torchtitan.models.qwen3.state_dict_adapter.Qwen3StateDictAdapter'
    """
    if mapping is None:
        return None
    if isinstance(mapping, str):
        return mapping
    cls = type(mapping)
    return f"adapter:{cls.__module__}.{cls.__qualname__}"


def check_mapping(mapping: Any) -> None:
    """Raises ValueError for a ``mapping=`` the save has no form for (before any collective).

    Example:
        >>> check_mapping(lambda k: k)
        Traceback (most recent call last):
        ValueError: save_pretrained(mapping=) takes "state_dict" or a state-dict adapter ...
    """
    if mapping is None or mapping in MAPPINGS:
        return
    if is_adapter(mapping) and callable(getattr(mapping, "to_hf", None)):
        return
    raise ValueError(
        f'save_pretrained(mapping=) takes "state_dict" or a state-dict adapter with to_hf and '
        f"from_hf (torchtitan's), not {type(mapping).__name__}: a rename dict or callable names "
        "the load's direction and has no checked inverse"
    )


def _raw_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (tied names share one object), without
    running state-dict hooks: the fused-QKV split hook all-gathers ``wqkv``.

    Raises:
        MappingError: a state-dict hook whose effect on the saved names is unknown.
    """
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for hook in (*mod._state_dict_hooks.values(), *mod._state_dict_pre_hooks.values()):
            name = str(getattr(getattr(hook, "hook", hook), "__qualname__", repr(hook)))
            if not name.endswith(_SPLIT_QKV):
                raise MappingError(
                    f"state_dict hook {name} has no known effect on the saved names", tensor=prefix
                )
        dot = f"{prefix}." if prefix else ""
        for n, p in mod._parameters.items():
            if p is not None:
                out[dot + n] = p
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                out[dot + n] = b
    return out


def _titan_form(
    model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Meta tensors of the global shapes under torchtitan's state-dict names: the fused QKV as
    its save hook splits it (``wq``: the query heads of every KV group, ``wk``, ``wv``), the
    checkpoint wrapper's name part removed (as ``get_model_state_dict`` does)."""
    qkv = {
        f"{n}.": m for n, m in model.named_modules() if any(c.__name__ == _QKV_CLASS for c in type(m).__mro__)
    }
    by_id: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        meta = by_id.setdefault(id(t), torch.empty(tuple(t.shape), dtype=out_dtype(t, dtype), device="meta"))
        prefix = next((p for p in qkv if name.startswith(p) and name[len(p) :].startswith("wqkv.")), None)
        clean = name.replace(WRAPPED, "")
        if prefix is None:
            out[clean] = meta
            continue
        mod, param = qkv[prefix], name[len(prefix) + len("wqkv.") :]
        hd, hpk = int(mod.head_dim), int(mod.heads_per_kv)
        n_kv = t.shape[0] // ((hpk + 2) * hd)
        tail = tuple(t.shape[1:])
        base = clean[: -len("wqkv." + param)]
        for part, rows in (("wq", n_kv * hpk * hd), ("wk", n_kv * hd), ("wv", n_kv * hd)):
            out[f"{base}{part}.{param}"] = torch.empty((rows, *tail), dtype=meta.dtype, device="meta")
    return out


def _canonical(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    tensors: dict[str, torch.Tensor] = {}
    names: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for name, t in state.items():
        canon = first.setdefault(id(t), name)
        if canon == name:
            tensors[name] = t
        names.setdefault(canon, []).append(name)
    return tensors, names


def _adapter_files(hub: dict[str, torch.Tensor], index: dict[str, int] | None) -> dict[str, str] | None:
    """torchtitan's file of every hub key from the adapter's ``fqn_to_index_mapping`` (read from
    ``hf_assets_path``'s index: the hub checkpoint's own split), named as torch's
    ``HuggingFaceStorageWriter`` names them; None without a map."""
    if not index:
        return None
    missing = sorted(k for k in hub if k not in index)
    if missing:
        raise MappingError(
            f"the adapter's fqn_to_index_mapping has no file for {missing[:5]}", tensor=missing[0]
        )
    last = max(index.values())
    return {k: f"model-{index[k]:05d}-of-{last:05d}.safetensors" for k in hub}


Tiles = tuple[dict[str, torch.Tensor], dict[str, tuple[SourcePiece, ...]]]


def mapped_layout(
    model: nn.Module, mapping: Any, dtype: torch.dtype | None, max_shard_size: int | str | None
) -> tuple[Layout, Tiles, bool]:
    """The output layout of ``model`` under ``mapping`` and the pieces tiling it.

    Args:
        model: the model (FSDP2 / TP DTensors, or plain).
        mapping: ``"state_dict"`` or a torchtitan-style state-dict adapter (``check_mapping``).
        dtype: optional cast of floating-point tensors.
        max_shard_size: the largest file before splitting; None with an adapter: its files, as
            torchtitan writes them (the ``fqn_to_index_mapping`` split, else one file).

    Returns:
        (layout, (canonical name -> model tensor, canonical name -> hub pieces) for ``plan_save``,
        whether config files are written: False for ``"state_dict"``, weights only).

    Raises:
        MappingError: the adapter's ``to_hf`` names a tensor the load's region form does not
            cover exactly once, a parameter no output tensor holds, or an unknown state-dict hook.

    Example:
        >>> layout, tiles, _ = mapped_layout(titan_model, adapter, torch.bfloat16, "5GB")
        >>> "model.layers.0.self_attn.q_proj.weight" in layout.tensors
        True
    """
    if mapping == STATE_DICT:
        # Every name, tie aliases too: accelerate's FSDP2 gather copies each to the CPU on its own,
        # so clean_state_dict_for_safetensors finds no shared storage and writes both.
        state = dict(model.state_dict(keep_vars=True))
        tensors, names = _canonical(state)
        hub = {
            n: torch.empty(tuple(t.shape), dtype=out_dtype(t, dtype), device="meta") for n, t in state.items()
        }
        layout = layout_of(
            hub, model, max_shard_size or "5GB", total_parameters=False
        )  # None: refused earlier
        tiles = {c: tuple(identity_piece(n, tuple(hub[n].shape)) for n in names[c]) for c in tensors}
        return layout, (tensors, tiles), False
    check_verified(mapping)  # before its to_hf runs: an unverified adapter is refused by name
    state = _raw_state(model)
    own = copy.deepcopy(mapping)  # to_hf records state (expert placements, the index map) the caller's keeps
    try:
        hub = dict(own.to_hf(_titan_form(model, state, dtype)))
    except Exception as exc:  # noqa: BLE001 - the adapter's own refusal, reported by name
        raise MappingError(
            f"the adapter's to_hf failed on meta tensors: {type(exc).__name__}: {exc}"
        ) from exc
    file_of = None
    size: int | str = 1 << 62  # None and no index map: one file, as torchtitan writes
    if max_shard_size is None:
        file_of = _adapter_files(hub, getattr(own, "fqn_to_index_mapping", None))
    else:
        size = max_shard_size
    layout = layout_of(hub, model, size, file_of=file_of)
    tensors, names = _canonical(state)
    targets = {n: tuple(int(s) for s in t.shape) for n, t in tensors.items()}
    conv = plan_mapping(mapping, model, layout.table, targets).conversion
    kept: dict[str, torch.Tensor] = {}
    pieces: dict[str, tuple[SourcePiece, ...]] = {}
    params = {id(p) for p in model.parameters()}
    for canon, t in tensors.items():
        found = next((conv.pieces[n] for n in names[canon] if n in conv.pieces), None)
        if found is None:
            if id(t) in params:
                raise MappingError(f"parameter '{canon}' has no tensor in the mapping's output", tensor=canon)
            continue  # a buffer the mapped format does not hold (torchtitan's to_hf drops it too)
        kept[canon], pieces[canon] = t, found
    try:
        _check_once(pieces, layout.table)
    except Exception as exc:  # noqa: BLE001 - the tiling's own words, as the mapping's error
        raise MappingError(f"the adapter's to_hf and its region form disagree: {exc}") from exc
    return layout, (kept, pieces), True
