"""accelerate's ``Accelerator.save_model`` against streamload's ``save_model``, run inside the
rank group (see rank_group.py): accelerate's own FSDP2 flow (the launcher's environment, the
plugin, ``from_pretrained``, ``Accelerator.prepare(model, optimizer)``), then the model written
by accelerate's own ``save_model`` and by ``streamload.integrations.accelerate_fsdp.save_model``
into two directories the test compares (every file's bytes)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from streamload.integrations.accelerate_fsdp import save_model
from streamload.tools.bench.save_clients_titan_accel import as_fsdp2, fsdp2_accelerator


def case_accelerate_save(
    rank: int, world: int, *, ckpt: str, out: str, dtype: str, max_shard_size: str
) -> dict[str, Any]:
    """Prepared by accelerate, saved by accelerate into ``out/accelerate`` and by streamload into
    ``out/streamload``; returns both directories and streamload's file list."""
    from transformers import AutoModelForCausalLM

    accelerator = fsdp2_accelerator()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert any(hasattr(p, "device_mesh") for p in model.parameters()), "accelerate did not shard"
    own, mine = os.path.join(out, "accelerate"), os.path.join(out, "streamload")
    as_fsdp2(accelerator).save_model(model, own, max_shard_size=max_shard_size)
    dist.barrier()  # accelerate's other ranks return while its main process writes
    report = save_model(accelerator, model, mine, max_shard_size=max_shard_size)
    return {"own": own, "streamload": mine, "files": sorted(report.files)}
