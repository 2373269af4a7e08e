"""Save cases on a 2x2 mesh of gloo ranks (run by tests/test_save_parallel.py): a model is
loaded into TP x FSDP, EP x FSDP or HSDP shards, then saved with each writer; the test
process compares the output with what transformers' own save_pretrained writes for the
same (gathered) model."""

from __future__ import annotations

from typing import Any

from cases_parallel import _load, _meta_model, shard_experts, tp_plan
from torch import nn

import streamload
from streamload.model.state import rebind_ties, record_state
from streamload.save.driver import save_pretrained

SHARD = "16KB"
BUCKET = 4096  # several buckets per rank, and pieces cut across buckets


def _saves(model: nn.Module, out: str, writers: tuple[str, ...], **kw: Any) -> dict[str, Any]:
    got: dict[str, Any] = {}
    for w in writers:
        rep = save_pretrained(model, f"{out}-{w}", writers=w, max_shard_size=SHARD, bucket_bytes=BUCKET, **kw)
        got[w] = {"writers": rep.writers, "bytes": rep.bytes_written, "peak": rep.peak_buffer_bytes}
    return got


def _tp_fsdp(ckpt: str) -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _meta_model(ckpt)
    parallelize_module(model, mesh["tp"], tp_plan(model))
    rebind_ties(model, record_state(model).ties)
    shard_experts(model, mesh, "tp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def case_tp_fsdp_save(
    rank: int, world: int, *, ckpt: str, out: str, writers: tuple[str, ...]
) -> dict[str, Any]:
    """TP over "tp" (colwise / rowwise, experts sharded over tp too), FSDP over "dp"."""
    model, mesh = _tp_fsdp(ckpt)
    _load(model, ckpt, rank, mesh, "owners")
    return _saves(model, out, writers)


def case_ep_fsdp_save(
    rank: int, world: int, *, ckpt: str, out: str, writers: tuple[str, ...]
) -> dict[str, Any]:
    """Fused experts sharded over "ep" (the expert dim), FSDP over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = _meta_model(ckpt)
    shard_experts(model, mesh, "ep")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    _load(model, ckpt, rank, mesh, "owners")
    placements = sorted({str(tuple(p.placements)) for n, p in model.named_parameters() if ".experts." in n})
    return {"saves": _saves(model, out, writers), "placements": placements}


def case_hsdp_save(rank: int, world: int, *, ckpt: str, out: str, writers: tuple[str, ...]) -> dict[str, Any]:
    """HSDP: replicate x shard mesh; one replica (replicate coordinate 0) writes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _meta_model(ckpt)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    streamload.load_checkpoint(model, ckpt, device_mesh=mesh, bucket_bytes=4096, progress=False)
    replica = mesh.get_local_rank("replicate")
    return {"replica": replica, "saves": _saves(model, out, writers)}


def case_pp_stage_save(
    rank: int, world: int, *, ckpts: tuple[str, str], out: str, writers: tuple[str, ...]
) -> dict[str, Any]:
    """A (pp, dp, tp) mesh of 2 x 2 x 1: each pipeline stage holds another model, sharded by FSDP
    over its own ``mesh["dp"]``, and saves it through its 2-D ``mesh["dp", "tp"]`` at the same
    time as the other stage: the save runs over that mesh's ranks (a group made by them alone),
    never the default group, and the world stays in step afterwards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh.get_coordinate()[0]
    sub = mesh["dp", "tp"]
    ckpt = ckpts[stage]
    model = _meta_model(ckpt)
    for layer in model.model.layers:
        fully_shard(layer, mesh=sub["dp"])
    fully_shard(model, mesh=sub["dp"])
    error = ""
    if stage == 1:  # src_rank is a global rank: 0 is not in this stage's group
        try:
            _load(model, ckpt, rank, sub, "owners")
        except streamload.PlacementError as exc:
            error = str(exc)
    _load(model, ckpt, rank, sub, "owners", src_rank=min(sub.mesh.flatten().tolist()))
    got = _saves(model, f"{out}{stage}", writers, device_mesh=sub)
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank of the world, after both stages' saves
    return {"stage": stage, "saves": got, "world_sum": float(t.item()), "error": error}
