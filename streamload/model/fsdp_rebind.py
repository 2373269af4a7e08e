"""FSDP parameters whose module attribute was re-bound after ``fully_shard`` (a re-tie on meta).

``fully_shard`` records, for each parameter, the module and attribute it swaps its sharded
and unsharded tensors into (FSDP internals: ``FSDPModule._get_fsdp_state()._fsdp_param_groups``,
each ``fsdp_params`` entry's ``_module_info`` and ``sharded_param`` / ``_unsharded_param``).
Re-tying afterwards (``model.tok_embeddings.weight = model.lm_head.weight``) leaves
``named_parameters`` showing one object while FSDP still manages the old one and installs it
again at the next forward: the tie is silently undone. Found here from the model as passed,
so ``fsdp_ties.tie_layout`` raises it as a ``TieError`` on every rank before the first byte.
tests/test_titan_hooks.py fails loudly if those internals change.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..errors import TieError


def rebound_params(model: nn.Module) -> list[tuple[str, str]]:
    """(attribute name, name of the object it now holds) for each FSDP parameter re-bound after sharding.

    Args:
        model: the model as the caller passed it.

    Returns:
        Sorted pairs; empty when nothing was re-bound (or no module is an ``FSDPModule``).

    Example:
        >>> rebound_params(model)  # after model.tok_embeddings.weight = model.lm_head.weight
        [('tok_embeddings.weight', 'lm_head.weight')]
    """
    mod_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    out = []
    try:
        for fsdp_mod in model.modules():
            if not isinstance(fsdp_mod, FSDPModule):
                continue
            for group in fsdp_mod._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    info = fp._module_info
                    # What FSDP may have installed: the shard, the unsharded parameter, or the
                    # post-forward shard (reshard_after_forward=int between forward and backward).
                    own = (
                        fp.sharded_param,
                        getattr(fp, "_unsharded_param", None),
                        getattr(fp, "_sharded_post_forward_param", None),
                    )
                    # The primary slot and the slots of a tie made before sharding (shared).
                    slots = [(info.module, info.param_name)]
                    slots += list(zip(info.shared_modules, info.shared_param_names, strict=True))
                    for module, attr in slots:
                        held = module._parameters.get(attr)
                        if any(held is t for t in own if t is not None):
                            continue
                        prefix = mod_names.get(id(module), "?")
                        name = f"{prefix}.{attr}" if prefix else attr
                        others = [n for n in by_id.get(id(held), []) if n != name]
                        out.append((name, (others or ["a tensor FSDP does not manage"])[0]))
    except AttributeError as exc:  # a torch release renamed what this reads: loud, by name
        raise TieError(
            f"cannot check FSDP's parameter slots for re-binding on this torch ({exc}); "
            "streamload reads FSDPParam._module_info / sharded_param (torch 2.13)"
        ) from exc
    return sorted(set(out))
