"""Cases of the architecture sweep, run inside the rank group (rank_group.py):
streamload.from_pretrained against transformers' from_pretrained, bit for bit."""

from __future__ import annotations

import warnings

import cases_load as cases

import streamload
from streamload.tools.archs import alias_groups, differing


def case_arch(rank: int, world: int, *, ckpt: str, ws: int) -> dict | None:
    """Loads ``ckpt`` at ``ws`` ranks (only rank 0 sees the files) and compares every
    parameter, buffer and alias group with transformers' own from_pretrained."""
    from transformers import AutoModelForCausalLM

    mesh = cases.mesh_for(ws)
    if mesh is None:
        return None
    path = ckpt if rank == 0 else cases.MISSING_PATH
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = streamload.from_pretrained(path, device_mesh=mesh, progress=False, bucket_bytes=1 << 16)
        ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype="auto")
    bad = differing(model, ref)
    mine, theirs = alias_groups(model), alias_groups(ref)
    return {
        "differ": bad,
        "aliases": mine,
        "ref_aliases": theirs,
        "params": sum(p.numel() for p in ref.parameters()),
    }


def case_unsharded_classes(rank: int, world: int, *, ckpt: str, ws: int) -> dict | None:
    """fully_shard's class swap, seen through unsharded_classes: transformers finds
    the model's conversion mapping on the sharded model as on the plain one."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    from streamload.integrations.pretrained import default_shard_fn, meta_model
    from streamload.model.hf import unsharded_class, unsharded_classes

    mesh = cases.mesh_for(ws)
    if mesh is None:
        return None
    model = meta_model(ckpt)
    plain_cls = type(model)

    def described(mapping: list) -> list[str]:
        return [f"{m!r} scope={getattr(m, 'scope_prefix', None)!r}" for m in mapping]

    plain = described(get_model_conversion_mapping(model))
    default_shard_fn(model, mesh)
    sharded_cls = type(model)
    # If torch stops swapping classes this fails, and unsharded_classes may be dropped.
    assert sharded_cls is not plain_cls and issubclass(sharded_cls, plain_cls)
    assert unsharded_class(model) is plain_cls
    with unsharded_classes(model):
        assert type(model) is plain_cls
        inside = described(get_model_conversion_mapping(model))
    assert type(model) is sharded_cls
    bare = described(get_model_conversion_mapping(model))
    return {"plain": plain, "inside": inside, "bare": bare}
