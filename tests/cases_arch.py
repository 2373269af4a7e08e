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
