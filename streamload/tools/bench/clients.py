"""Bench strategies that run real clients' own load code (AReaL 1.0.4, accelerate's
FSDP2 ``prepare``), and the same with streamload swapped in at the client's call site.

Each has the bench's signature ``(ckpt, mesh, dtype, opts) -> model`` and is timed from
the model build to the loaded, sharded model. The clients are imported inside the
functions: the bench runs without them.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...integrations.accelerate_fsdp import fsdp2_load_full_state_dict as accelerate_entry
from ...integrations.areal import fsdp2_load_full_state_dict as areal_entry


def areal_model(
    ckpt: str, dtype: torch.dtype, rank0_on_meta: bool, untie: bool = False
) -> tuple[nn.Module, Any, Any, Any]:
    """AReaL's ``FSDPEngine._create_device_model`` under ``memory_efficient_load``.

    Args:
        ckpt: the checkpoint directory (its config).
        dtype: AReaL's ``optimizer_dtype`` (fp32 master weights by default).
        rank0_on_meta: build rank 0 on meta too (AReaL: ``from_config`` on the CPU there).
        untie: build with ``tie_word_embeddings=False`` whatever the config says.

    Returns:
        (model, model config, AReaL's ``TrainEngineConfig``, its ``ParallelHelper``).

    Example:
        >>> model, cfg, tc, helper = areal_model(ckpt, torch.float32, rank0_on_meta=True)
    """
    from areal.api.alloc_mode import FSDPParallelStrategy
    from areal.api.cli_args import TrainEngineConfig
    from areal.engine.fsdp_utils.parallel import ParallelHelper
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ckpt)
    if untie:
        cfg.tie_word_embeddings = False
    tc = TrainEngineConfig(experiment_name="streamload", trial_name="bench", path=ckpt)
    tc.fsdp.memory_efficient_load = True
    helper = ParallelHelper.from_parallel_strategy(
        FSDPParallelStrategy(data_parallel_size=dist.get_world_size())
    )
    on_meta = rank0_on_meta or dist.get_rank() != 0
    with torch.device("meta" if on_meta else "cpu"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
    return model, cfg, tc, helper


def areal_shard(model: nn.Module, cfg: Any, tc: Any, helper: Any) -> None:
    """AReaL's ``parallelize_model`` over its world mesh (FSDP2 over ``dp_sp``), no offload."""
    from areal.engine.fsdp_utils.parallel import parallelize_model

    parallelize_model(
        model,
        config=tc,
        model_config=cfg,
        nd_device_mesh=helper.world_mesh,
        parallel_helper=helper,
        cpu_offload=None,
        wrap_policy=tc.fsdp.wrap_policy,
    )


def areal_rank0_state(model: nn.Module, ckpt: str) -> dict[str, torch.Tensor]:
    """``FSDPEngine.initialize``'s ``is_llm_cpu_load`` step: rank 0 fills its model from
    the raw checkpoint with ``load_state_dict(strict=False)`` and hands over ``state_dict()``;
    the other ranks hand over ``{}``.

    Args:
        model: AReaL's model (real on rank 0).
        ckpt: the checkpoint directory.

    Returns:
        The full state dict on rank 0, ``{}`` elsewhere.

    Example:
        >>> full_state = areal_rank0_state(model, ckpt)
    """
    from areal.utils.save_load import get_state_dict_from_repo_id_or_path

    if dist.get_rank() != 0:
        return {}
    model.load_state_dict(get_state_dict_from_repo_id_or_path(ckpt), strict=False)
    return model.state_dict()


def _areal_at_call(ckpt: str, dtype: torch.dtype, load: Any) -> nn.Module:
    model, cfg, tc, helper = areal_model(ckpt, dtype, rank0_on_meta=False)
    full_state = areal_rank0_state(model, ckpt)
    areal_shard(model, cfg, tc, helper)
    load(model, full_state, None, tie_word_embeddings=cfg.tie_word_embeddings)
    return model


def load_areal_own(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """AReaL's own path: rank 0 ``load_state_dict(raw, strict=False)`` then ``state_dict()``,
    ``parallelize_model``, AReaL's ``fsdp2_load_full_state_dict`` (a broadcast)."""
    from areal.engine.fsdp_utils import fsdp2_load_full_state_dict

    return _areal_at_call(ckpt, dtype, fsdp2_load_full_state_dict)


def load_areal_streamload(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """AReaL's path with streamload's entry swapped in at the call, the same state dict."""
    return _areal_at_call(ckpt, dtype, areal_entry)


def load_areal_streamload_path(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """The recommended AReaL recipe: every rank on meta, the checkpoint path on rank 0."""
    model, cfg, tc, helper = areal_model(ckpt, dtype, rank0_on_meta=True)
    areal_shard(model, cfg, tc, helper)
    areal_entry(
        model, ckpt if dist.get_rank() == 0 else {}, None, tie_word_embeddings=cfg.tie_word_embeddings
    )
    return model


def accelerate_launch_env() -> None:
    """What `accelerate launch` with an FSDP config exports, for this rank of the existing process
    group, and accelerate's cached state reset so that the next ``Accelerator`` reads it."""
    from accelerate.state import AcceleratorState, PartialState

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        ACCELERATE_USE_FSDP="true",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    AcceleratorState._reset_state(True)
    PartialState._reset_state()


def accelerate_prepare(ckpt: str, dtype: torch.dtype, load: Any = None) -> tuple[nn.Module, Any]:
    """accelerate's own FSDP2 flow on this rank: the launcher's environment,
    ``FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)``,
    ``from_pretrained``, ``Accelerator.prepare(model, optimizer)``.

    Args:
        ckpt: the checkpoint directory.
        dtype: ``from_pretrained``'s dtype.
        load: None for accelerate as shipped, else the function its load call site is
            patched to for the call (e.g. ``streamload.accelerate_fsdp2_load_full_state_dict``).

    Returns:
        The prepared model and optimizer.

    Example:
        >>> model, opt = accelerate_prepare(ckpt, torch.bfloat16, accelerate_entry)
    """
    import accelerate.utils.fsdp_utils as fsdp_utils
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    accelerate_launch_env()
    original = fsdp_utils.fsdp2_load_full_state_dict
    try:
        if load is not None:
            fsdp_utils.fsdp2_load_full_state_dict = load
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        # accelerate enables FSDP for accelerator devices only (MULTI_GPU, ...): on CPU
        # ranks, set what it sets there, so prepare() takes its FSDP2 path.
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
    return model, optimizer


def load_accelerate_own(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """accelerate's own FSDP2 ``prepare`` with ``cpu_ram_efficient_loading``."""
    return accelerate_prepare(ckpt, dtype)[0]


def load_accelerate_streamload(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """The same with the one-line change: streamload's entry at the load call site."""
    return accelerate_prepare(ckpt, dtype, accelerate_entry)[0]


def _import_areal() -> None:
    """AReaL's modules, imported before the clock starts (import cost is not load cost)."""
    import areal.engine.fsdp_utils  # noqa: F401
    import areal.engine.fsdp_utils.parallel  # noqa: F401
    import areal.utils.save_load  # noqa: F401


def _import_accelerate() -> None:
    import accelerate.utils.fsdp_utils  # noqa: F401


for _fn in (load_areal_own, load_areal_streamload, load_areal_streamload_path):
    _fn.warmup = _import_areal  # type: ignore[attr-defined]
for _fn in (load_accelerate_own, load_accelerate_streamload):
    _fn.warmup = _import_accelerate  # type: ignore[attr-defined]

CLIENT_STRATEGIES = {
    "areal_own": load_areal_own,
    "areal_streamload": load_areal_streamload,
    "areal_streamload_path": load_areal_streamload_path,
    "accelerate_own": load_accelerate_own,
    "accelerate_streamload": load_accelerate_streamload,
}
