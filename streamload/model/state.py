"""The model side: what to fill, where each rank holds it, ties and buffers.

Everything here is recorded on the model before it is materialised, because
``to_empty()`` is where ties can silently break and buffers become garbage.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ModelMismatchError, PlacementError, TieError
from ..io.copy_ops import ST_DTYPES
from ..plan.buckets import Placement
from .hf import init_buffers_like_from_pretrained
from .layouts import check_placements, local_layout, nested_shard_mismatch


@dataclass
class TieGroup:
    """Names that must be one Parameter object; ``canonical`` is streamed."""

    canonical: str
    aliases: list[str]


@dataclass
class ModelState:
    """What streamload needs to know about a model before loading.

    Attributes:
        params: canonical parameter name -> the parameter (DTensor or plain).
        buffers: persistent buffer name -> tensor (loaded from the checkpoint).
        ties: tie groups (canonical first).
        saved_buffers: non-persistent buffers with real values, cloned to CPU.
        meta_buffers: non-persistent buffers that are on meta (to recompute).
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    ties: list[TieGroup]
    saved_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    meta_buffers: list[str] = field(default_factory=list)

    @property
    def alias_names(self) -> set[str]:
        return {a for g in self.ties for a in g.aliases}

    def targets(self) -> dict[str, torch.Tensor]:
        """Every tensor the checkpoint fills: canonical params, then persistent buffers."""
        return {**self.params, **self.buffers}


def _split(name: str) -> tuple[str, str]:
    mod, _, attr = name.rpartition(".")
    return mod, attr


def _declared_ties(model: nn.Module) -> dict[str, str]:
    """alias -> canonical from transformers' declarations (empty elsewhere)."""
    get = getattr(model, "get_expanded_tied_weights_keys", None)
    if get is None:
        return {}
    # transformers' helper reads each sub-model's own config.tie_word_embeddings
    # (a composite model's may differ from its text config's): ask it alone.
    try:
        return dict(get(all_submodels=True))
    except Exception:  # noqa: BLE001 - a model's own helper failing must not stop a load
        return {}


def record_state(model: nn.Module) -> ModelState:
    """Records parameters, ties (by identity and declaration) and buffers."""
    by_id: dict[int, list[str]] = {}
    objects: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        objects[name] = p
    groups: dict[str, list[str]] = {}
    for names in by_id.values():
        groups[names[0]] = names[1:]
    for alias, canonical in _declared_ties(model).items():
        if alias not in objects or canonical not in objects:
            continue
        canon = next((c for c, al in groups.items() if canonical == c or canonical in al), canonical)
        if alias in groups and alias != canon:  # declared tie already broken: fold it in
            groups[canon] = sorted({*groups.get(canon, []), alias, *groups.pop(alias)} - {canon})
        elif alias not in groups.get(canon, []) and alias != canon:
            groups.setdefault(canon, []).append(alias)
    ties = [TieGroup(c, list(a)) for c, a in groups.items() if a]
    params = {c: objects[c] for c in groups}
    persistent: dict[str, torch.Tensor] = {}
    saved: dict[str, torch.Tensor] = {}
    meta: list[str] = []
    for mod_name, mod in model.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is None:
                continue
            full = f"{mod_name}.{bname}" if mod_name else bname
            if bname in mod._non_persistent_buffers_set:
                if buf.is_meta:
                    meta.append(full)
                else:
                    saved[full] = buf.detach().to("cpu", copy=True)
            else:
                persistent[full] = buf
    return ModelState(params, persistent, ties, saved, meta)


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a DTensor, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def local_placement(t: torch.Tensor, name: str = "") -> Placement:
    """This rank's box (or boxes) of ``t`` in global coordinates, and its dtype.

    Raises PlacementError for placements that cannot be filled exactly, and
    when torch's local shard does not have the shape the boxes imply (a
    layout torch derives differently from ``model.layouts``).
    """
    dtype = ST_DTYPES[t.dtype]
    if hasattr(t, "device_mesh") and hasattr(t, "placements"):
        mesh, placements = t.device_mesh, tuple(t.placements)
        check_placements(name, placements, t.dim())
        parts, want = local_layout(tuple(t.shape), tuple(mesh.shape), placements, mesh.get_coordinate())
        have = tuple(local_tensor(t).shape)
        if want != have:
            nested = nested_shard_mismatch(
                tuple(t.shape), tuple(mesh.shape), placements, mesh.get_coordinate(), have
            )
            if nested is not None:
                raise PlacementError(f"{list(t.shape)}: {nested}", tensor=name)
            raise PlacementError(
                f"placements {placements} on mesh {tuple(mesh.shape)}: local shard is {list(have)}, "
                f"torch's layout semantics give {list(want)}",
                tensor=name,
            )
        if len(parts) == 1:
            return Placement(parts[0][0], dtype)
        return Placement(tuple((0, 0) for _ in t.shape), dtype, parts)
    return Placement(tuple((0, int(s)) for s in t.shape), dtype)


def fsdp_device(model: nn.Module) -> torch.device | None:
    """The device ``fully_shard`` recorded for ``model`` (None when no module is sharded).

    FSDP2 records ``current_device()`` of the mesh's device type when ``fully_shard``
    runs and all-gathers there; it offers no public getter, so this reads its state
    (``FSDPModule._get_fsdp_state()._device``). tests/test_gpu_path.py fails when torch
    renames it, and a load raises ModelMismatchError rather than guess.

    Raises:
        ModelMismatchError: torch no longer has the attribute.
        PlacementError: the model's sharded modules recorded different devices.

    Example:
        >>> fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        >>> fsdp_device(model)
        device(type='cpu')
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 records nothing
        return None
    found: dict[str, torch.device] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            device = module._get_fsdp_state()._device
        except AttributeError as exc:
            raise ModelMismatchError(
                f"cannot read the device FSDP2 recorded on torch {torch.__version__} ({exc}); "
                "streamload needs updating for this torch"
            ) from exc
        if not isinstance(device, torch.device):
            raise ModelMismatchError(f"FSDP2's recorded device is {device!r} on torch {torch.__version__}")
        found.setdefault(str(device), device)
        if len(found) > 1:
            raise PlacementError(
                f"fully_shard recorded different devices for one model ({sorted(found)}, the last for "
                f"'{name or '<root>'}'): it records the current device when it runs, so set it once first"
            )
    return next(iter(found.values()), None)


def check_fsdp_device(model: nn.Module, device: torch.device) -> None:
    """Refuses to materialise a ``fully_shard``-ed meta model away from the device FSDP2 recorded.

    FSDP2 all-gathers on the device it recorded at ``fully_shard`` time (the current
    device then), so shards materialised anywhere else (e.g. on the process group's
    bound device after ``fully_shard`` ran with another device current) would break
    its first forward.

    Raises:
        PlacementError: naming both devices and the fix.
    """
    recorded = fsdp_device(model)
    if recorded is not None and recorded != device:
        raise PlacementError(
            f"fully_shard recorded {recorded} for this model (the current device when it ran), but the load "
            f"runs on {device} (the model's tensors, else the process group's bound device): call "
            f"torch.{device.type}.set_device({device}) before fully_shard, or bind the group to {recorded}"
        )


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocates meta tensors on ``device`` (values are filled by the load)."""
    model.to_empty(device=device)


@torch.no_grad()
def restore_buffers(model: nn.Module, state: ModelState) -> list[str]:
    """Puts non-persistent buffers back after ``to_empty()``.

    Buffers that had real values are copied back; on a transformers model
    every non-persistent buffer is then recomputed as its ``from_pretrained``
    does (``init_buffers_like_from_pretrained``); elsewhere buffers built on
    meta are recomputed by ``_init_weights`` on modules without parameters.

    Returns:
        Names of non-persistent buffers that could not be restored.
    """
    modules = dict(model.named_modules())
    for name, value in state.saved_buffers.items():
        mod_name, attr = _split(name)
        buf = modules[mod_name]._buffers[attr]
        if buf is not None:
            buf.copy_(value.to(buf.device))
    # transformers models: every non-persistent buffer as from_pretrained computes it.
    hf_failed = init_buffers_like_from_pretrained(model)
    unrestored: list[str] = list(hf_failed or [])
    init = getattr(model, "_init_weights", None)
    done: set[str] = set()
    for name in state.meta_buffers if hf_failed is None else []:
        mod_name, _ = _split(name)
        mod = modules[mod_name]
        if mod_name in done:
            continue
        if init is not None and not list(mod.parameters(recurse=False)):
            init(mod)
            done.add(mod_name)
        else:
            unrestored.append(name)
    if unrestored:
        warnings.warn(
            f"streamload: non-persistent buffers could not be recomputed: {unrestored}; "
            "build the model with real buffers (e.g. accelerate.init_empty_weights()) to keep them",
            stacklevel=3,
        )
    return unrestored


def get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter (else buffer) ``name`` exactly as its module holds it.

    Example:
        >>> get_tensor(model, "model.embed_tokens.weight")
    """
    mod_name, attr = _split(name)
    mod = model.get_submodule(mod_name)
    t: torch.Tensor | None = mod._parameters.get(attr)
    if t is None:
        t = mod._buffers.get(attr)
    if t is None:
        t = getattr(mod, attr)
    assert t is not None
    return t


def rebind_ties(model: nn.Module, ties: Iterable[TieGroup]) -> None:
    """Makes every alias the canonical Parameter object again, then checks it."""
    for g in ties:
        canonical = get_tensor(model, g.canonical)
        for alias in g.aliases:
            mod_name, attr = _split(alias)
            mod = model.get_submodule(mod_name)
            if mod._parameters.get(attr) is not canonical:
                mod._parameters[attr] = canonical  # type: ignore[assignment]
    check_ties(model, ties)


def check_ties(model: nn.Module, ties: Iterable[TieGroup]) -> None:
    for g in ties:
        canonical = get_tensor(model, g.canonical)
        for alias in g.aliases:
            if get_tensor(model, alias) is not canonical:
                raise TieError(
                    f"'{alias}' is not the same Parameter as '{g.canonical}' after loading", tensor=alias
                )


def ignore_patterns(model: nn.Module) -> tuple[re.Pattern[str] | None, re.Pattern[str] | None]:
    """transformers' regexes for keys to ignore when missing / unexpected."""
    missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    names = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in names):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in names):
        unexpected.add(r"(^|\.)position_ids$")

    def compile_(ps: set[str]) -> re.Pattern[str] | None:
        return re.compile("|".join(f"({p})" for p in sorted(ps))) if ps else None

    return compile_(missing), compile_(unexpected)
