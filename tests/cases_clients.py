"""Multi-rank cases for the real clients (AReaL, accelerate), the hub-cache layout and
lazy sources: each runs the client's own functions, then compares with transformers."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from cases_load import compare_model, reference, tied

import streamload


def _fused_experts(model: torch.nn.Module) -> set[str]:
    return {
        n for n, _ in model.named_parameters() if ".experts.gate_up_proj" in n or ".experts.down_proj" in n
    }


# -- AReaL -----------------------------------------------------------------------------------
def _areal_build(ckpt: str, rank: int, on_meta: bool, untie: bool = False) -> tuple[Any, Any, Any, Any, Any]:
    """AReaL 1.0.4's FSDPEngine model build on CPU: ``_create_device_model`` under
    ``memory_efficient_load`` (rank 0 ``from_config`` on the CPU, the others on meta) and
    the helper and mesh ``FSDPEngine`` makes; ``on_meta`` builds rank 0 on meta too."""
    from areal.api.alloc_mode import FSDPParallelStrategy
    from areal.api.cli_args import TrainEngineConfig
    from areal.engine.fsdp_utils.parallel import ParallelHelper
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ckpt)
    if untie:
        cfg.tie_word_embeddings = False
    tc = TrainEngineConfig(experiment_name="streamload", trial_name="test", path=ckpt)
    tc.fsdp.memory_efficient_load = True
    helper = ParallelHelper.from_parallel_strategy(
        FSDPParallelStrategy(data_parallel_size=dist.get_world_size())
    )
    dtype = getattr(torch, tc.optimizer_dtype)  # AReaL's fp32 master weights
    with torch.device("meta" if on_meta or rank != 0 else "cpu"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
    return model, cfg, tc, helper, dtype


def _areal_rank0_state(model: Any, ckpt: str, rank: int) -> dict:
    """``FSDPEngine.initialize``'s ``is_llm_cpu_load`` branch: rank 0 fills its model
    from the raw checkpoint with ``strict=False`` and hands over ``state_dict()``."""
    from areal.utils.save_load import get_state_dict_from_repo_id_or_path

    if rank != 0:
        return {}
    pretrained = get_state_dict_from_repo_id_or_path(ckpt)
    model.load_state_dict(pretrained, strict=False)
    return model.state_dict()


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
    from areal.engine.fsdp_utils.parallel import parallelize_model

    model, cfg, tc, helper, dtype = _areal_build(ckpt, rank, on_meta=loader == "streamload_lazy")
    if loader in ("areal", "streamload_dict"):
        full_state: Any = _areal_rank0_state(model, ckpt, rank)
    elif loader == "streamload_path":
        full_state = ckpt if rank == 0 else {}
    else:
        full_state = streamload.Checkpoint.lazy(ckpt) if rank == 0 else {}
    parallelize_model(
        model,
        config=tc,
        model_config=cfg,
        nd_device_mesh=helper.world_mesh,
        parallel_helper=helper,
        cpu_offload=None,
        wrap_policy=tc.fsdp.wrap_policy,
    )
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
    from areal.engine.fsdp_utils.parallel import parallelize_model

    model, cfg, tc, helper, _ = _areal_build(ckpt, rank, on_meta=True, untie=True)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    parallelize_model(
        model, config=tc, model_config=cfg, nd_device_mesh=helper.world_mesh, parallel_helper=helper
    )
    try:
        streamload.areal_fsdp2_load_full_state_dict(
            model, ckpt if rank == 0 else {}, None, tie_word_embeddings=True
        )
    except streamload.TieError as exc:
        return type(exc).__name__
    raise AssertionError("no TieError")


# -- accelerate -------------------------------------------------------------------------------
def _accelerate_env(rank: int, world: int) -> None:
    # What `accelerate launch` (FSDP config) / torchrun export; the process group already exists.
    # ACCELERATE_USE_FSDP with the plugin's FSDP_CPU_RAM_EFFICIENT_LOADING makes transformers'
    # from_pretrained read the weights on the main process only.
    os.environ.update(
        ACCELERATE_USE_FSDP="true",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )


def case_accelerate(rank: int, world: int, *, ckpt: str, use_streamload: bool, dtype: torch.dtype) -> dict:
    """accelerate's own flow: ``FullyShardedDataParallelPlugin(fsdp_version=2,
    cpu_ram_efficient_loading=True)``, ``from_pretrained`` under it, ``Accelerator.prepare``;
    with ``use_streamload`` the single call site is patched (the documented one-line change).

    Returns the parameters that differ from transformers, bit for bit, and the tie state.
    """
    import accelerate.utils.fsdp_utils as fsdp_utils
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    _accelerate_env(rank, world)
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    original = fsdp_utils.fsdp2_load_full_state_dict
    reports: list[Any] = []

    def entry(*args: Any, **kwargs: Any) -> Any:
        reports.append(streamload.accelerate_fsdp2_load_full_state_dict(*args, **kwargs))
        return reports[-1]

    try:
        if use_streamload:
            fsdp_utils.fsdp2_load_full_state_dict = entry
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        # accelerate turns FSDP on only for accelerator devices (MULTI_GPU, ...); on CPU
        # ranks set what it sets there (state.py), so prepare() takes its FSDP2 path.
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
        # FSDP2 in accelerate wants the optimizer too: it re-points it at the sharded parameters.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
    finally:
        fsdp_utils.fsdp2_load_full_state_dict = original
    ref = reference(ckpt, dtype)
    sharded = sum(hasattr(p, "device_mesh") for p in model.parameters())
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters()}, "optimizer not on the loaded parameters"
    return {
        "bad": compare_model(model, ref),
        "tied": tied(model),
        "ref_tied": tied(ref),
        "sharded": sharded,
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
