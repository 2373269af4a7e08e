"""Parallelism cases run inside the rank group (see rank_group.py): TP x FSDP
with torch's own parallelize_module, expert parallel x FSDP, and pipeline
stages, each compared bit-exactly with transformers' from_pretrained."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from cases_load import MISSING_PATH, compare_model, reference, tied
from torch import nn

import streamload
from streamload.model.state import rebind_ties, record_state


def _meta_model(ckpt: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, dtype=config.dtype)


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """torchtitan's llama plan: colwise q/k/v/gate/up, rowwise o/down, embedding rowwise, lm_head colwise."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{pre}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{pre}.self_attn.o_proj"] = RowwiseParallel()
        if hasattr(layer.mlp, "gate_proj"):
            plan[f"{pre}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{pre}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{pre}.mlp.down_proj"] = RowwiseParallel()
    return plan


def shard_experts(model: nn.Module, mesh: Any, dim_name: str) -> int:
    """Fused expert tensors sharded over ``dim_name`` (expert parallel: Shard(0) is the expert dim)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    n = 0
    sub = mesh[dim_name]
    for mod in model.modules():
        if type(mod).__name__.endswith("Experts"):
            for pname, p in list(mod.named_parameters(recurse=False)):
                dt = distribute_tensor(torch.empty(p.shape, dtype=p.dtype, device="meta"), sub, [Shard(0)])
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))
                n += 1
    return n


def _load(
    model: nn.Module, ckpt: str, rank: int, mesh: Any, readers: str, **kw: Any
) -> streamload.LoadReport:
    nodes = readers == "node"
    if nodes:  # two simulated nodes of two ranks; the first rank of each reads
        os.environ["STREAMLOAD_NODE"] = str(rank // 2)
    sees = readers != "src" or rank == 0 or (nodes and rank % 2 == 0)
    try:
        return streamload.load_checkpoint(
            model, ckpt if sees else MISSING_PATH, device_mesh=mesh, bucket_bytes=4096, progress=False,
            readers=readers, **kw,
        )  # fmt: skip
    finally:
        os.environ.pop("STREAMLOAD_NODE", None)


def case_tp_fsdp(rank: int, world: int, *, ckpt: str, readers: str, experts_on: str = "tp") -> dict[str, Any]:
    """parallelize_module over "tp", then fully_shard per block and the root over "dp" (2x2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _meta_model(ckpt)
    parallelize_module(model, mesh["tp"], tp_plan(model))
    # parallelize_module distributes each module's weight apart, so a tied head becomes its own
    # DTensor (the same Shard(0) over "tp" as the embedding's): tie again before fully_shard, or
    # FSDP manages it as a parameter of its own that no load can re-tie (TieError).
    rebind_ties(model, record_state(model).ties)
    experts = shard_experts(model, mesh, experts_on)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    report = _load(model, ckpt, rank, mesh, readers)
    ref = reference(ckpt, None)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    assert tied(model) == tied(ref)
    placements = sorted({str(tuple(p.placements)) for p in model.parameters()})
    return {"placements": placements, "experts": experts, "reader": report.reader}


def case_ep_fsdp(rank: int, world: int, *, ckpt: str, readers: str = "owners") -> dict[str, Any]:
    """Fused experts sharded over "ep" (expert dim), FSDP over "dp"; each reader's bytes are its share."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from streamload.io.checkpoint import Checkpoint

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = _meta_model(ckpt)
    experts = shard_experts(model, mesh, "ep")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    # map_files=False: every byte of a rank's shards is then read, none mapped, so bytes_read is its share.
    report = _load(model, ckpt, rank, mesh, readers, map_files=False)
    ref = reference(ckpt, None)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    ckpt_bytes = Checkpoint(ckpt).total_bytes if hasattr(Checkpoint, "total_bytes") else None
    expert_local = expert_full = share = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = p.to_local() if hasattr(p, "to_local") else p
        nbytes = local.numel() * 2  # the checkpoint is bf16, as are the parameters
        share += nbytes
        if ".experts." in name:
            expert_local += nbytes
            expert_full += p.numel() * 2
    return {
        "bytes_read": report.bytes_read,
        "share": share,
        "expert_local": expert_local,
        "expert_full": expert_full,
        "experts": experts,
        "ckpt_bytes": ckpt_bytes,
        "placements": sorted(
            {str(tuple(p.placements)) for n, p in model.named_parameters() if ".experts." in n}
        ),
    }


def pipeline_stage(ckpt: str, stage: int, stages: int, extra_layer: bool = False) -> nn.Module:
    """The model as a pipeline split leaves stage ``stage``: its layers only, names kept.

    The first stage keeps the embedding, the last the final norm and lm_head;
    ``extra_layer`` adds a layer index the checkpoint does not have.
    """
    model = _meta_model(ckpt)
    layers = model.model.layers
    per = len(layers) // stages
    keep = {str(i): layers[i] for i in range(stage * per, (stage + 1) * per)}
    if extra_layer:
        keep[str(len(layers))] = layers[0].__class__(model.config, len(layers)).to("meta")
    model.model.layers = nn.ModuleDict(keep)  # a ModuleDict keeps the checkpoint's layer indices
    if stage != 0:
        model.model.embed_tokens = None
    if stage != stages - 1:
        model.model.norm = None
        model.lm_head = None
    return model


def case_pipeline_stage(
    rank: int,
    world: int,
    *,
    ckpt: str,
    readers: str = "src",
    unexpected: str = "ignore",
    extra_layer: bool = False,
) -> dict[str, Any]:
    """Two stages of two ranks each (mesh "pp" x "dp"); each stage loads what it holds over its own group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    model = pipeline_stage(ckpt, stage, 2, extra_layer)
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    src = 2 * stage  # the stage's first rank reads
    try:
        report = streamload.load_checkpoint(
            model, ckpt if rank == src or readers != "src" else MISSING_PATH, device_mesh=mesh["dp"],
            src_rank=src, bucket_bytes=4096, progress=False, readers=readers, unexpected=unexpected,
        )  # fmt: skip
    except streamload.KeyMismatchError as exc:
        return {"error": type(exc).__name__, "missing": exc.missing, "unexpected": exc.unexpected}
    ref = reference(ckpt, None)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    names = [n for n, _ in model.named_parameters()]
    return {
        "stage": stage,
        "params": len(names),
        "layers": sorted(model.model.layers),
        "skipped": report.unexpected_keys,
    }
