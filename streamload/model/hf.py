"""transformers' own view of a sharded model: its classes as transformers
registered them, and non-persistent buffers computed as ``from_pretrained``
computes them."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn


def unsharded_class(module: nn.Module) -> type:
    """The class ``module`` had before ``fully_shard``.

    ``fully_shard`` swaps a module's class for a subclass of ``FSDPModule``
    and the original (named ``FSDP<Name>``, defined in torch), which hides
    the module from transformers' lookups by class name and makes
    ``is_custom_code()`` true.

    Args:
        module: any module, sharded or not.

    Returns:
        The first class in its MRO that is not an ``FSDPModule``.

    Example:
        >>> unsharded_class(fully_shard(model)) is type_before
        True
    """
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


@contextlib.contextmanager
def unsharded_classes(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block every ``fully_shard``-ed module has its original class.

    transformers chooses a model's key renames and conversions by class name,
    ``model_type`` and whether the class is its own code
    (``get_model_conversion_mapping``); on a sharded model it would find none.

    Example:
        >>> with unsharded_classes(model):
        ...     mapping = get_model_conversion_mapping(model)
    """
    swapped: list[tuple[nn.Module, type]] = []
    try:
        for mod in model.modules():
            orig = unsharded_class(mod)
            if orig is not type(mod):
                swapped.append((mod, type(mod)))
                mod.__class__ = orig
        yield model
    finally:
        for mod, cls in swapped:
            mod.__class__ = cls


def _owners(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
    """(module, the PreTrainedModel whose ``_initialize_weights`` transformers applies to it)."""
    from transformers.modeling_utils import PreTrainedModel

    # As initialize_weights' smart_apply: a sub-model dispatches its own init to its subtree.
    def walk(mod: nn.Module, owner: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
        for child in mod.children():
            yield from walk(child, child if isinstance(child, PreTrainedModel) else owner)
        yield mod, owner

    yield from walk(model, model)


@torch.no_grad()
def init_buffers_like_from_pretrained(model: nn.Module) -> list[str] | None:
    """Recomputes non-persistent buffers exactly as transformers' ``from_pretrained`` does.

    ``from_pretrained`` builds the model on meta (under the load dtype), gives
    non-persistent buffers fresh storage, and computes them in
    ``initialize_weights`` after the dtype context has closed, skipping every
    tensor flagged ``_is_hf_initialized`` (the loaded ones). Buffers computed
    in ``__init__`` under the load dtype can differ (codegen's
    ``embed_positions`` in bfloat16), so the same init is applied here, with
    the same dispatch, to the modules that own non-persistent buffers, every
    parameter and persistent buffer flagged so that only those buffers are
    written. Modules without such buffers are not visited: their init may
    compute with (sharded) parameters it would not write anyway.

    Args:
        model: a materialised transformers model (sharded or not).

    Returns:
        None when ``model`` is not a transformers ``PreTrainedModel`` (nothing
        done), else the buffers whose module's init raised (left as built).

    Example:
        >>> init_buffers_like_from_pretrained(model)
        []
    """
    if "transformers.modeling_utils" not in sys.modules:
        return None  # a model of transformers' has imported it: this one is not (and stays light)
    try:
        from transformers import initialization as hf_init
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    for _, p in model.named_parameters(remove_duplicate=False):
        p._is_hf_initialized = True  # type: ignore[attr-defined]
    for mod in model.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                buf._is_hf_initialized = True  # type: ignore[attr-defined]
    failed: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    with unsharded_classes(model), hf_init.guard_torch_init_functions():
        custom = model.is_custom_code()
        for mod, owner in _owners(model):
            own = [b for b in mod._non_persistent_buffers_set if mod._buffers.get(b) is not None]
            if not own:
                continue
            # from_pretrained's skeleton was built without init: nothing is marked done yet.
            mod.__dict__.pop("_is_hf_initialized", None)
            for b in own:
                mod._buffers[b].__dict__.pop("_is_hf_initialized", None)  # type: ignore[union-attr]
            try:
                owner._initialize_weights(mod, custom)  # type: ignore[operator]
            except Exception:  # noqa: BLE001 - reported as unrestored: the buffers keep their built values
                prefix = names[id(mod)]
                failed.extend(f"{prefix}.{b}" if prefix else b for b in sorted(own))
    return failed
