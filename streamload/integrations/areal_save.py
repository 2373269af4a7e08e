"""AReaL's HF export, written by every rank: a drop-in for AReaL 1.0.4's
``FSDPEngine._save_model_to_hf(self, path, tokenizer, processor)`` (``areal/engine/fsdp_engine.py``).

AReaL reaches that method from ``FSDPEngine.save(meta)`` with ``weight_format="hf"`` and from
``_update_weights_from_disk`` (a rollout engine reloading from disk, every step). AReaL gathers
the full state dict to rank 0's CPU (``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``), casts floating tensors to the compute dtype (``config.dtype``, bf16 by
default, from fp32 masters), and rank 0 alone calls ``save_pretrained(path, state_dict=...)``, then
``model_config.save_pretrained(path)`` and the tokenizer / processor (not under LoRA). Here the
weights are written by ``streamload.save_pretrained(dtype=compute dtype)``: every rank writes its
own shards' bytes (cast in the packing copy); rank 0 writes AReaL's config and tokenizer /
processor into the save's temporary directory (``extra_files``), so they are committed with the
weights, atomically, or not at all.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import SaveError
from ..save.driver import SaveReport, save_pretrained

# transformers' save_pretrained default, which AReaL's call keeps.
MAX_SHARD_SIZE = "50GB"


def save_model_to_hf(
    engine: Any,
    path: str,
    tokenizer: Any = None,
    processor: Any = None,
    *,
    timeout: float | None = None,
    **kwargs: Any,
) -> SaveReport:
    """``FSDPEngine._save_model_to_hf``, streamed (same arguments, same directory); collective.

    Args:
        engine: AReaL's ``FSDPEngine`` (reads ``model``, ``model_config``, ``config.dtype``,
            ``config.use_lora`` and ``cpu_group``).
        path: the directory to write.
        tokenizer: saved on rank 0 when given (not under LoRA), as AReaL does.
        processor: the same.
        timeout: seconds to wait for ranks that have not called (``save_pretrained``).
        **kwargs: more ``streamload.save_pretrained`` keywords (``writers=``, ``bucket_bytes=``).

    Returns:
        This rank's SaveReport.

    Raises:
        SaveError: on every rank for a LoRA engine (AReaL's own save writes PEFT's adapter files
            then, which this entry does not), or when any rank's write failed (rank 0's config,
            tokenizer and processor included; the target is then untouched).

    Example:
        >>> FSDPEngine._save_model_to_hf = save_model_to_hf  # or the one-line diff in areal.md
    """
    if engine.model is None:
        raise RuntimeError("Model not initialized")  # AReaL's own check, the same on every rank
    if engine.config.use_lora:
        raise SaveError(
            "AReaL's HF save of a LoRA engine writes PEFT's adapter files; streamload's entry "
            "writes full checkpoints only: keep AReaL's own _save_model_to_hf for use_lora"
        )
    compute = getattr(torch, engine.config.dtype)

    def processing(tmp: str) -> None:
        # AReaL writes its model_config over the config.json save_pretrained wrote, then the
        # tokenizer and processor: into the save's temporary directory, committed with the weights.
        engine.model_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if processor is not None:
            processor.save_pretrained(tmp)

    report = save_pretrained(
        engine.model,
        path,
        dtype=compute,
        max_shard_size=kwargs.pop("max_shard_size", MAX_SHARD_SIZE),
        config=engine.model_config,
        timeout=timeout,
        extra_files=processing,
        **kwargs,
    )
    return report
