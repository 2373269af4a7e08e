"""Client save strategies for `streamload bench --save`: accelerate's and torchtitan's own
exports, called as the frameworks ship them, and streamload's entries for them.

Each is ``fn(model, out_dir, options)`` on every rank of the bench's group, with the bench's
already-sharded transformers FSDP2 model (pass ``--strategies module:function``):

- ``save_accelerate_own``: ``Accelerator.save_model(model, out, max_shard_size)``: accelerate's
  FSDP2 ``get_state_dict`` (full state dict on rank 0's CPU) and its writer on the main process;
- ``save_accelerate_streamload``: ``streamload.integrations.accelerate_fsdp.save_model``;
- ``save_titan_own`` / ``save_titan_own_indexed``: torchtitan 0.3.0's
  ``CheckpointManager.dcp_save(to_hf=True)``, its own code, with an identity adapter (the model
  is a transformers one: its names are the hub's already); without an index map (one file,
  consolidated by rank 0 alone, as when ``hf_assets_path`` has no index) or with the map of
  ``max_shard_size``'s split (every rank consolidates its files, as with a hub index).

Neither framework writes a config: each strategy adds the model's ``config.json`` on rank 0
after the export (a few hundred bytes, inside the timed run), only so that the bench's
correctness pass (transformers' ``from_pretrained`` of the output) can load it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .clients import accelerate_launch_env
from .save_strategies import _tied_keys


def fsdp2_accelerator() -> Any:
    """An ``Accelerator`` with accelerate's FSDP2 plugin on this rank (the process group exists).

    On CPU ranks accelerate would not enable FSDP (it does so for accelerator devices only): the
    state is set as accelerate sets it on GPUs, so ``save_model`` takes its FSDP2 path.

    Example:
        >>> fsdp2_accelerator().is_fsdp2
        True
    """
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerate_launch_env()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
    return as_fsdp2(Accelerator(cpu=not torch.cuda.is_available(), fsdp_plugin=plugin), plugin)


def as_fsdp2(accelerator: Any, plugin: Any = None) -> Any:
    """``accelerator`` with the FSDP2 state accelerate sets on GPUs; on CPU ranks it falls back to
    ``MULTI_CPU`` (at construction, and again inside ``prepare``: observed with accelerate
    1.16), so callers set it again before ``save_model``, or ``get_state_dict`` takes its
    non-FSDP path (a plain ``state_dict()`` of DTensors)."""
    from accelerate.utils import DistributedType

    if not torch.cuda.is_available():
        accelerator.state.distributed_type = DistributedType.FSDP
        if plugin is not None:
            accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2, "accelerate is not in its FSDP2 state"
    return accelerator


def _config(model: nn.Module, out: str) -> None:
    """The bench's check needs a config neither framework writes: rank 0 adds it."""
    if dist.get_rank() == 0 and getattr(model, "config", None) is not None:
        model.config.save_pretrained(out)  # type: ignore[operator, union-attr]
    dist.barrier()


def save_accelerate_own(model: nn.Module, out: str, opts: dict[str, Any]) -> None:
    """accelerate's own ``Accelerator.save_model`` (FSDP2: full state dict gathered to rank 0)."""
    as_fsdp2(fsdp2_accelerator()).save_model(model, out, max_shard_size=opts["max_shard_size"])
    dist.barrier()  # accelerate returns on the other ranks while the main process writes
    _config(model, out)


def save_accelerate_streamload(model: nn.Module, out: str, opts: dict[str, Any]) -> Any:
    """``streamload.integrations.accelerate_fsdp.save_model``: accelerate's files, every rank writing."""
    from ...integrations.accelerate_fsdp import save_model

    report = save_model(None, model, out, max_shard_size=opts["max_shard_size"])
    _config(model, out)
    return report


def _titan_dcp_save(model: nn.Module, out: str, index: dict[str, int] | None) -> None:
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager

    tied = _tied_keys(model)
    # As torchtitan's adapter: tied lm_head dropped; names as they are (a transformers model).
    adapter = SimpleNamespace(
        to_hf=lambda sd: {k: v for k, v in sd.items() if k not in tied}, fqn_to_index_mapping=index
    )
    owner = SimpleNamespace(sd_adapter=adapter, pg=None)
    state = ModelWrapper(model).state_dict()
    CheckpointManager.dcp_save(owner, state, out, AsyncMode.DISABLED, to_hf=True)  # type: ignore[arg-type]
    dist.barrier()  # rank 0 consolidates alone (no index): the others must not read before
    _config(model, out)


def save_titan_own(model: nn.Module, out: str, opts: dict[str, Any]) -> None:
    """torchtitan 0.3.0's ``dcp_save(to_hf=True)`` without an index map: ``out/sharded`` by every
    rank, then one ``model-00001-of-00001.safetensors`` and the index consolidated by rank 0."""
    _titan_dcp_save(model, out, None)


def save_titan_own_indexed(model: nn.Module, out: str, opts: dict[str, Any]) -> None:
    """torchtitan 0.3.0's ``dcp_save(to_hf=True)`` with an index map (``max_shard_size``'s split):
    every rank consolidates its share of the files (5 threads, as torchtitan)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    tied = _tied_keys(model)
    shapes = {
        k: torch.empty(v.shape, dtype=v.dtype, device="meta")
        for k, v in model.state_dict().items()
        if k not in tied
    }
    split = split_torch_state_dict_into_shards(shapes, max_shard_size=opts["max_shard_size"])
    order = {name: i for i, name in enumerate(sorted(split.filename_to_tensors), start=1)}
    index = {key: order[name] for name, keys in split.filename_to_tensors.items() for key in keys}
    _titan_dcp_save(model, out, index)


__all__ = [
    "as_fsdp2",
    "fsdp2_accelerator",
    "save_accelerate_own",
    "save_accelerate_streamload",
    "save_titan_own",
    "save_titan_own_indexed",
]
