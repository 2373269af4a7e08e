"""verl's ``hf_model`` checkpoint content, written by every rank: a drop-in for verl 0.9.1's
``FSDPCheckpointManager`` (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``).

verl's ``save_checkpoint`` with ``"hf_model"`` in ``checkpoint.save_contents`` gathers the full
state dict to rank 0's CPU (``get_fsdp_full_state_dict``), builds an empty bf16 copy of the model
there and calls transformers' ``save_pretrained(state_dict=...)`` into ``<local_path>/huggingface``:
rank 0 holds the whole model on the host while the others wait. Here the same directory is written
by ``streamload.save_pretrained``: the file layout planned from global shapes on every rank, each
rank writing its own shards' bytes, the weight files committed atomically; the weights keep the
dtype verl's state dict has (the parameters'), ties are stored once (verl's
``drop_tied_target_keys``), the generation config is the one verl picks, and the files verl's rank 0
wrote there before (config, tokenizer / processor, custom code) are kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from torch import nn
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as _VerlManager

from ..save.driver import SaveReport, save_pretrained

HF_DIR = "huggingface"
# transformers' save_pretrained default, which verl's call keeps.
MAX_SHARD_SIZE = "50GB"


def verl_generation_config(model: nn.Module) -> Any:
    """The generation config verl's ``hf_model`` save writes: the one beside
    ``config.name_or_path`` when there is one, else transformers' default from the model config
    (what verl's fresh ``from_config`` copy carries); None for a model that cannot generate.

    Example:
        >>> verl_generation_config(model).eos_token_id
        2
    """
    from transformers import GenerationConfig

    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        return None
    config: Any = model.config
    if getattr(config, "name_or_path", None):
        try:
            return GenerationConfig.from_pretrained(config.name_or_path)
        except Exception:  # noqa: BLE001 - verl's rule: no file there, the model config's default
            pass
    return GenerationConfig.from_model_config(config)


@contextlib.contextmanager
def _generation_config(module: nn.Module, gen: Any) -> Iterator[None]:
    """``model.generation_config`` set to ``gen`` for one save (what save_pretrained writes)."""
    model: Any = module
    if gen is None:
        yield
        return
    had = "generation_config" in vars(model)
    saved = getattr(model, "generation_config", None)
    model.generation_config = gen
    try:
        yield
    finally:
        if had:
            model.generation_config = saved
        else:
            vars(model).pop("generation_config", None)


def save_hf_model(
    model: nn.Module,
    local_path: str,
    *,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    timeout: float | None = None,
    **kwargs: Any,
) -> SaveReport:
    """verl's ``hf_model`` save, streamed: ``<local_path>/huggingface`` as verl writes it, every
    rank writing its own bytes; collective over the model's group.

    Args:
        model: verl's FSDP2 module (``FSDPCheckpointManager.model``).
        local_path: the checkpoint step directory verl saves into.
        max_shard_size: as transformers' (verl keeps its default, 50GB).
        timeout: seconds to wait for ranks that have not called (``save_pretrained``).
        **kwargs: more ``streamload.save_pretrained`` keywords (``writers=``, ``bucket_bytes=``).

    Returns:
        This rank's SaveReport.

    Example:
        >>> save_hf_model(engine.module, "ckpts/global_step_100/actor")
    """
    unwrap = getattr(model, "_fsdp_wrapped_module", model)
    out = os.path.join(local_path, HF_DIR)
    with _generation_config(unwrap, verl_generation_config(unwrap)):
        return save_pretrained(unwrap, out, max_shard_size=max_shard_size, timeout=timeout, **kwargs)


class FSDPCheckpointManager(_VerlManager):  # type: ignore[misc]
    """verl's ``FSDPCheckpointManager`` whose ``hf_model`` content is written by every rank
    (``save_hf_model``) instead of gathered to rank 0; everything else is verl's own code.

    The checkpoint is registered (verl's rotation of old checkpoints) after the weights are
    written, as verl does.

    Example:
        >>> # verl/workers/engine/fsdp/transformer_impl.py
        >>> from streamload.integrations.verl_save import FSDPCheckpointManager
    """

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: Any = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
    ) -> None:
        hf_model = local_path is not None and self.should_save_hf_model
        if not hf_model:
            return super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)
        contents = self.checkpoint_save_contents
        registered: list[tuple[Any, ...]] = []
        self.checkpoint_save_contents = [c for c in contents if c != "hf_model"]
        self.register_checkpoint = lambda *args: registered.append(args)  # type: ignore[method-assign]
        try:
            super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)
        finally:
            self.checkpoint_save_contents = contents
            del self.register_checkpoint
        save_hf_model(self.model, local_path)
        for args in registered:
            self.register_checkpoint(*args)
