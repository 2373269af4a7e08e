"""Multi-rank cases for the real clients (AReaL, accelerate), the hub-cache layout and
lazy sources: each runs the client's own functions, then compares with transformers."""

from __future__ import annotations

from typing import Any

import torch
from cases_load import compare_model, reference, tied

import streamload
from streamload.tools.bench.clients import accelerate_prepare, areal_model, areal_rank0_state, areal_shard


def _fused_experts(model: torch.nn.Module) -> set[str]:
    return {
        n for n, _ in model.named_parameters() if ".experts.gate_up_proj" in n or ".experts.down_proj" in n
    }


# -- AReaL -----------------------------------------------------------------------------------
def case_areal(rank: int, world: int, *, ckpt: str, loader: str) -> dict:
    """AReaL's model build and ``parallelize_model``, then one of the loads:

    - ``areal``: AReaL's own ``fsdp2_load_full_state_dict`` (set_model_state_dict broadcast);
    - ``streamload_dict``: streamload's AReaL entry swapped in at the call, same full_state;
    - ``streamload_path``: the entry given the checkpoint directory on rank 0 (AReaL's
      ``load_state_dict(strict=False)`` step skipped);
    - ``streamload_lazy``: every rank on meta, ``Checkpoint.lazy(path)`` on rank 0.

    Returns the parameters that differ from transformers' ``from_pretrained`` (fp32),
    bit for bit, and whether the embedding is tied as transformers ties it.
    """
    from areal.engine.fsdp_utils import fsdp2_load_full_state_dict as areal_load

    dtype = torch.float32  # AReaL's optimizer_dtype: fp32 master weights
    model, cfg, tc, helper = areal_model(ckpt, dtype, rank0_on_meta=loader == "streamload_lazy")
    if loader in ("areal", "streamload_dict"):
        full_state: Any = areal_rank0_state(model, ckpt)
    elif loader == "streamload_path":
        full_state = ckpt if rank == 0 else {}
    else:
        full_state = streamload.Checkpoint.lazy(ckpt) if rank == 0 else {}
    areal_shard(model, cfg, tc, helper)
    load = areal_load if loader == "areal" else streamload.areal_fsdp2_load_full_state_dict
    load(model, full_state, None, tie_word_embeddings=cfg.tie_word_embeddings)
    del full_state
    ref = reference(ckpt, dtype)
    return {
        "bad": compare_model(model, ref),
        "fused": sorted(_fused_experts(ref)),
        "tied": tied(model),
        "ref_tied": tied(ref),
    }


def case_areal_tie_flag(rank: int, world: int, *, ckpt: str) -> str:
    """``tie_word_embeddings=True`` for a model built untied (its config says so): a
    TieError on every rank, before the load."""
    model, cfg, tc, helper = areal_model(ckpt, torch.float32, rank0_on_meta=True, untie=True)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    areal_shard(model, cfg, tc, helper)
    try:
        streamload.areal_fsdp2_load_full_state_dict(
            model, ckpt if rank == 0 else {}, None, tie_word_embeddings=True
        )
    except streamload.TieError as exc:
        return type(exc).__name__
    raise AssertionError("no TieError")


# -- accelerate -------------------------------------------------------------------------------
def case_accelerate(rank: int, world: int, *, ckpt: str, use_streamload: bool, dtype: torch.dtype) -> dict:
    """accelerate's own flow (``streamload.tools.bench.clients.accelerate_prepare``: the
    launcher's environment, ``FullyShardedDataParallelPlugin(fsdp_version=2,
    cpu_ram_efficient_loading=True)``, ``from_pretrained``, ``Accelerator.prepare``); with
    ``use_streamload`` its single load call site is patched (the documented one-line change).

    Returns the parameters that differ from transformers, bit for bit, and the tie state.
    """
    reports: list[Any] = []

    def entry(*args: Any, **kwargs: Any) -> Any:
        reports.append(streamload.accelerate_fsdp2_load_full_state_dict(*args, **kwargs))
        return reports[-1]

    model, optimizer = accelerate_prepare(ckpt, dtype, entry if use_streamload else None)
    ref = reference(ckpt, dtype)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters()}, "optimizer not on the loaded parameters"
    return {
        "bad": compare_model(model, ref),
        "tied": tied(model),
        "ref_tied": tied(ref),
        "sharded": sum(hasattr(p, "device_mesh") for p in model.parameters()),
        "streamload_calls": len(reports),
    }


# -- hub cache and lazy sources ---------------------------------------------------------------
def case_load_path(rank: int, world: int, *, ckpt: str, readers: str = "src", lazy: bool = False) -> dict:
    """``from_pretrained``'s meta build, sharded, then ``load_checkpoint`` from ``ckpt``
    (rank 0 only for ``src``); the result bit for bit against transformers."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamload.integrations.pretrained import default_shard_fn

    cfg = AutoConfig.from_pretrained(ckpt)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=cfg.dtype)
    from torch.distributed.device_mesh import init_device_mesh

    default_shard_fn(model, init_device_mesh("cpu", (world,)))
    src: Any = streamload.Checkpoint.lazy(ckpt) if lazy else ckpt
    report = streamload.load_checkpoint(
        model, src if rank == 0 or readers != "src" else None, readers=readers
    )
    ref = reference(ckpt, cfg.dtype)
    return {"bad": compare_model(model, ref), "tied": tied(model), "reader": report.reader}


def case_lazy_error(rank: int, world: int, *, ckpt: str, recipe: str) -> str:
    """A missing or corrupt checkpoint given on rank 0 as the recipe passes it
    (``path`` or ``lazy``): the named error every rank raises (no hang)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from streamload.integrations.pretrained import default_shard_fn
    from streamload.tools.synthetic import make_config

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(make_config("qwen2", layers=1))
    from torch.distributed.device_mesh import init_device_mesh

    default_shard_fn(model, init_device_mesh("cpu", (world,)))
    src: Any = streamload.Checkpoint.lazy(ckpt) if recipe == "lazy" else ckpt
    try:
        streamload.fsdp2_load_full_state_dict(model, src if rank == 0 else {})
    except streamload.StreamloadError as exc:
        return type(exc).__name__
    raise AssertionError("the load succeeded")
