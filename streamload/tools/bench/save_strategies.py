"""Save strategies for `streamload bench --save`, each run on every rank of a process group.

Each takes (model, out_dir, options) with the sharded model and writes a Hugging Face checkpoint to
``out_dir``; they reproduce the call sequences frameworks use today, with plain torch and
transformers."""

from __future__ import annotations

import importlib
import os
import typing
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SAVE_STRATEGIES = ["streamload_owners", "streamload_src", "rank0", "dcp_consolidate"]


def save_streamload(writers: str) -> Callable[[nn.Module, str, dict[str, Any]], Any]:
    """``streamload.save_pretrained(model, out, writers=writers)`` on every rank; returns its SaveReport."""

    def save(model: nn.Module, out: str, opts: dict[str, Any]) -> Any:
        import streamload

        save_pretrained = typing.cast(Any, streamload).save_pretrained
        return save_pretrained(model, out, writers=writers, max_shard_size=opts["max_shard_size"])

    return save


def save_rank0(model: nn.Module, out: str, opts: dict[str, Any]) -> None:
    """verl's and accelerate's HF export: the full state dict gathered to rank 0's CPU
    (``get_model_state_dict`` with ``full_state_dict`` and ``cpu_offload``), then rank 0 alone
    calls transformers' ``save_pretrained`` with it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        typing.cast(Any, model).save_pretrained(out, state_dict=sd, max_shard_size=opts["max_shard_size"])
    del sd
    dist.barrier()


def _tied_keys(model: nn.Module) -> set[str]:
    """State-dict keys transformers leaves out of a checkpoint because they are tied to another."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return set()
    return {k for k in model.state_dict() if k.endswith("lm_head.weight")}


def save_dcp_consolidate(model: nn.Module, out: str, opts: dict[str, Any]) -> None:
    """torchtitan's HF export (``last_save_in_hf``): every rank writes its shards with
    ``dcp.save`` and ``HuggingFaceStorageWriter(save_distributed=True)`` into ``out/sharded``,
    then ``consolidate_safetensors_files_on_every_rank`` assembles the full files (each output
    file by one rank) and the index; rank 0 adds config.json. Keys are the model's state-dict
    names (for a fused MoE model those are not the hub's per-expert names); tied keys are left
    out as transformers leaves them out. The sharded copy stays, as torchtitan leaves it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from huggingface_hub import split_torch_state_dict_into_shards
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )

    tied = _tied_keys(model)
    state = {k: v for k, v in model.state_dict().items() if k not in tied}
    # Files assigned from the global shapes, as the consolidated checkpoint will hold them.
    shapes = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    split = split_torch_state_dict_into_shards(shapes, max_shard_size=opts["max_shard_size"])
    order = {name: i for i, name in enumerate(sorted(split.filename_to_tensors), start=1)}
    mapping = {key: order[name] for name, keys in split.filename_to_tensors.items() for key in keys}
    sharded = os.path.join(out, "sharded")
    writer = dcp.HuggingFaceStorageWriter(path=sharded, save_distributed=True, fqn_to_index_mapping=mapping)
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    consolidate_safetensors_files_on_every_rank(sharded, out, mapping)
    if dist.get_rank() == 0:
        cfg = typing.cast(Any, model)
        cfg.config.save_pretrained(out)
        if getattr(cfg, "generation_config", None) is not None:
            cfg.generation_config.save_pretrained(out)
    dist.barrier()


# Each takes (model, out_dir, options) on every rank; streamload's return their SaveReport.
SAVERS: dict[str, Callable[[nn.Module, str, dict[str, Any]], Any]] = {
    "streamload_owners": save_streamload("owners"),
    "streamload_src": save_streamload("src"),
    "rank0": save_rank0,
    "dcp_consolidate": save_dcp_consolidate,
}


# The clients' own HF exports, run from their code, and streamload's entries for them (the frameworks
# must be installed: the clients extra and .ci/clients-nodeps.txt): name -> "module:function".
_VERL_AREAL = "streamload.tools.bench.save_clients_verl_areal"
_TITAN_ACCEL = "streamload.tools.bench.save_clients_titan_accel"
CLIENT_SAVERS: dict[str, str] = {
    "verl_own": f"{_VERL_AREAL}:save_verl_own",
    "verl_streamload": f"{_VERL_AREAL}:save_verl_streamload",
    "areal_own": f"{_VERL_AREAL}:save_areal_own",
    "areal_streamload": f"{_VERL_AREAL}:save_areal_streamload",
    "accelerate_own": f"{_TITAN_ACCEL}:save_accelerate_own",
    "accelerate_streamload": f"{_TITAN_ACCEL}:save_accelerate_streamload",
    "titan_own": f"{_TITAN_ACCEL}:save_titan_own",
    "titan_own_indexed": f"{_TITAN_ACCEL}:save_titan_own_indexed",
}


def saver_fn(name: str) -> Callable[[nn.Module, str, dict[str, Any]], Any]:
    """A save strategy by name: a key of ``SAVERS``, or ``"package.module:function"`` (a client's
    own export, called as ``function(model, out_dir, options)`` on every rank).

    Example:
        >>> saver_fn("rank0") is save_rank0
        True
    """
    if name in SAVERS:
        return SAVERS[name]
    name = CLIENT_SAVERS.get(name, name)
    module, sep, attr = name.partition(":")
    if not sep:
        raise KeyError(
            f"unknown save strategy {name!r}: one of {SAVE_STRATEGIES + list(CLIENT_SAVERS)} or 'module:function'"
        )
    return typing.cast(Any, getattr(importlib.import_module(module), attr))
