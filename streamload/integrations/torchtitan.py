"""torchtitan's HF export (``checkpoint.last_save_in_hf``), written by streamload.

torchtitan 0.3.0's ``CheckpointManager._save_last_step`` with ``last_save_in_hf=True``
casts ``ModelWrapper.state_dict()`` (the fused QKV split by its state-dict hook, an
all-gather of every layer's ``wqkv``) to ``export_dtype``, renames it with the adapter's
``to_hf`` (grouped experts split per expert) and ``dcp.save``-s it through
``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``: every rank
writes its shards into ``<step>/sharded/``, then rank 0 alone reads them back and writes
the consolidated ``model-00001-of-00001.safetensors`` and the index (with the adapter's
``fqn_to_index_mapping``: every rank consolidates its share of the hub checkpoint's files).

``save_hf`` writes the same tensors (names, dtypes, shapes, bytes) with
``streamload.save_pretrained(part, path, mapping=adapter)``: no all-gather, no second copy
on disk, every rank writing its own byte ranges of the final files, atomically.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import MappingError
from ..save.driver import SaveReport, save_pretrained


def save_hf(
    model_parts: nn.Module | Sequence[nn.Module],
    checkpoint_id: str | os.PathLike,
    sd_adapter: Any,
    *,
    export_dtype: torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    **kwargs: Any,
) -> SaveReport:
    """torchtitan's ``last_save_in_hf`` export: the model written as the hub checkpoint its
    adapter's ``to_hf`` names; collective over the model's ranks.

    Args:
        model_parts: ``CheckpointManager.states[MODEL].model`` (one part: pipeline stages
            hold different layers, which one save cannot yet combine; over the default group,
            as called here, stages holding different parts plan different files and the save
            is a SaveError on every rank, never a partial checkpoint: do not pass a stage's own
            ``process_group``).
        checkpoint_id: the step directory (``self._create_checkpoint_id(curr_step)``).
        sd_adapter: torchtitan's state-dict adapter (``self.sd_adapter``).
        export_dtype: ``self.export_dtype``: floating-point tensors cast to it, as torchtitan's
            ``v.to(self.export_dtype)``.
        max_shard_size: None (default): torchtitan's files: the hub checkpoint's own split
            (``model-0000i-of-0000n.safetensors``) when the adapter has an
            ``fqn_to_index_mapping`` (an index in ``hf_assets_path``), else one file
            (``model.safetensors``); or the largest file before splitting, as transformers'.
        **kwargs: further ``save_pretrained`` options (``writers``, ``bucket_bytes``, ``timeout``).

    Returns:
        The SaveReport of this rank.

    Raises:
        MappingError: on every rank, an adapter whose ``to_hf`` has no verified region form
            (see ``save_pretrained(mapping=)``), or more than one model part.
        SaveError: on every rank when a write failed; ``checkpoint_id`` is left as it was.

    Example:
        >>> from streamload.integrations.torchtitan import save_hf
        >>> save_hf(self.states[MODEL].model, self._create_checkpoint_id(step), self.sd_adapter,
        ...         export_dtype=self.export_dtype)
    """
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    if len(parts) != 1:
        raise MappingError(f"{len(parts)} model parts (pipeline parallel): one save writes one part")
    return save_pretrained(
        parts[0],
        checkpoint_id,
        mapping=sd_adapter,
        dtype=export_dtype,
        max_shard_size=max_shard_size,
        **kwargs,
    )
