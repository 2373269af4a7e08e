"""streamload: stream safetensors checkpoints into FSDP2 shards."""

from __future__ import annotations

from .checkpoint import Checkpoint, TensorInfo
from .errors import (
    CheckpointError,
    CheckpointFileError,
    CheckpointIndexError,
    CopyOpError,
    DTypeMismatchError,
    HeaderError,
    KeyMismatchError,
    ModelMismatchError,
    RemoteRankError,
    ShapeMismatchError,
    StreamloadError,
    TensorNotFoundError,
    TieError,
    UnsafePathError,
)
from .frameworks import fsdp2_load_full_state_dict
from .load import load_checkpoint
from .pretrained import from_pretrained
from .report import LoadReport

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointFileError",
    "CheckpointIndexError",
    "CopyOpError",
    "DTypeMismatchError",
    "HeaderError",
    "KeyMismatchError",
    "LoadReport",
    "ModelMismatchError",
    "RemoteRankError",
    "ShapeMismatchError",
    "StreamloadError",
    "TensorInfo",
    "TensorNotFoundError",
    "TieError",
    "UnsafePathError",
    "__version__",
    "from_pretrained",
    "fsdp2_load_full_state_dict",
    "load_checkpoint",
]
