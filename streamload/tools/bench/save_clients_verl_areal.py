"""Save strategies for ``streamload bench --save``: verl's and AReaL's own HF exports, run from
their code on the bench's sharded transformers model, against streamload's entries for them.

Each is ``fn(model, out_dir, options)`` on every rank (``save_strategies.saver_fn``'s
``"module:function"``), e.g. ``--strategies
streamload.tools.bench.save_clients_verl_areal:save_verl_own``. Both frameworks keep
transformers' default ``max_shard_size`` (50GB), so these ignore ``options["max_shard_size"]`` and
their streamload counterparts use the same default: the two write the same directory.
The frameworks are imported here, when the strategy is looked up, not inside the timed save.
"""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist
from torch import nn

# Each client is optional: its strategies fail by name where it is missing.
_CLIENTS: dict[str, Any] = {}
try:
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as _VerlManager

    from ...integrations.verl_save import FSDPCheckpointManager as _StreamloadManager

    _CLIENTS.update(verl_own=_VerlManager, verl_streamload=_StreamloadManager)
except ImportError:  # pragma: no cover - verl not installed
    pass
try:
    from areal.engine.fsdp_engine import FSDPEngine as _ArealEngine

    _CLIENTS.update(areal=_ArealEngine)
except ImportError:  # pragma: no cover - AReaL not installed
    pass

AREAL_DTYPE = "bfloat16"  # AReaL's default compute dtype (TrainEngineConfig.dtype)


def _verl_save(which: str, model: nn.Module, out: str) -> None:
    """verl's ``save_checkpoint`` with ``hf_model`` only into ``out``, then its ``huggingface/``
    moved up into ``out`` (what the bench reads), verl's ``fsdp_config.json`` dropped."""
    cls = _CLIENTS.get(which)
    if cls is None:
        raise ImportError("verl is not installed: pip install --no-deps -r .ci/clients-nodeps.txt")
    manager = cls(
        model=model,
        optimizer=None,
        lr_scheduler=None,
        checkpoint_config={"save_contents": ["hf_model"], "load_contents": ["model"]},
    )
    manager.save_checkpoint(out, global_step=0)
    dist.barrier()
    if dist.get_rank() == 0:
        hf = os.path.join(out, "huggingface")
        for name in os.listdir(hf):
            os.replace(os.path.join(hf, name), os.path.join(out, name))
        shutil.rmtree(hf)
        os.remove(os.path.join(out, "fsdp_config.json"))
    dist.barrier()


def save_verl_own(model: nn.Module, out: str, opts: dict[str, Any]) -> None:
    """verl 0.9.1's ``FSDPCheckpointManager`` ``hf_model`` save: full state dict gathered to rank
    0's CPU, an empty bf16 copy built there, transformers' ``save_pretrained`` by rank 0."""
    _verl_save("verl_own", model, out)


def save_verl_streamload(model: nn.Module, out: str, opts: dict[str, Any]) -> None:
    """The same with ``streamload.integrations.verl_save.FSDPCheckpointManager``: every rank
    writes its own bytes (``save_hf_model``)."""
    _verl_save("verl_streamload", model, out)


def _areal_engine(model: nn.Module, opts: dict[str, Any]) -> Any:
    """A stand-in ``FSDPEngine`` with what ``_save_model_to_hf`` reads, AReaL's own dtype helpers
    bound to it (compute dtype ``opts["areal_dtype"]``, default bf16)."""
    engine_cls = _CLIENTS.get("areal")
    if engine_cls is None:
        raise ImportError("AReaL is not installed: pip install --no-deps -r .ci/clients-nodeps.txt")
    config = SimpleNamespace(dtype=opts.get("areal_dtype", AREAL_DTYPE), use_lora=False)
    engine = SimpleNamespace(model=model, model_config=model.config, config=config, cpu_group=None)
    engine._compute_dtype = engine_cls._compute_dtype.__get__(engine)
    engine._cast_to_compute_dtype = engine_cls._cast_to_compute_dtype.__get__(engine)
    return engine


def save_areal_own(model: nn.Module, out: str, opts: dict[str, Any]) -> None:
    """AReaL 1.0.4's ``FSDPEngine._save_model_to_hf``: full state dict to rank 0's CPU, cast to
    the compute dtype there, rank 0's ``save_pretrained`` and ``model_config.save_pretrained``."""
    engine = _areal_engine(model, opts)
    _CLIENTS["areal"]._save_model_to_hf(engine, out, None, None)


def save_areal_streamload(model: nn.Module, out: str, opts: dict[str, Any]) -> Any:
    """The same through ``streamload.integrations.areal_save.save_model_to_hf``: every rank casts
    and writes its own bytes; returns the SaveReport."""
    from ...integrations.areal_save import save_model_to_hf

    return save_model_to_hf(_areal_engine(model, opts), out, None, None)
