"""streamload: stream safetensors checkpoints into FSDP2 shards."""

from __future__ import annotations

from .errors import (
    CheckpointError,
    CheckpointFileError,
    CheckpointIndexError,
    CopyOpError,
    DTypeMismatchError,
    HeaderError,
    KeyMismatchError,
    MappingError,
    ModelMismatchError,
    OptionMismatchError,
    PeerError,
    PlacementError,
    RankAbsentError,
    RankLostError,
    RemoteRankError,
    SaveError,
    ShapeMismatchError,
    StreamloadError,
    TensorNotFoundError,
    TieError,
    UnsafePathError,
)
from .integrations.accelerate_fsdp import fsdp2_load_full_state_dict as accelerate_fsdp2_load_full_state_dict
from .integrations.areal import fsdp2_load_full_state_dict as areal_fsdp2_load_full_state_dict
from .integrations.frameworks import fsdp2_load_full_state_dict
from .integrations.pretrained import from_pretrained
from .io.checkpoint import Checkpoint, LazyCheckpoint, TensorInfo
from .load.driver import load_checkpoint
from .report import LoadReport
from .save.driver import SaveReport, save_pretrained
from .sync.driver import SyncReport, sync_weights
from .sync.errors import EngineDeadError, EngineMismatchError, SyncError
from .sync.remote import EngineServer, RemoteEngine
from .sync.source import HubSource

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointFileError",
    "CheckpointIndexError",
    "CopyOpError",
    "DTypeMismatchError",
    "EngineDeadError",
    "EngineMismatchError",
    "EngineServer",
    "HeaderError",
    "HubSource",
    "KeyMismatchError",
    "LazyCheckpoint",
    "MappingError",
    "LoadReport",
    "ModelMismatchError",
    "OptionMismatchError",
    "PeerError",
    "PlacementError",
    "RankAbsentError",
    "RankLostError",
    "RemoteEngine",
    "RemoteRankError",
    "SaveError",
    "SaveReport",
    "ShapeMismatchError",
    "StreamloadError",
    "SyncError",
    "SyncReport",
    "TensorInfo",
    "TensorNotFoundError",
    "TieError",
    "UnsafePathError",
    "__version__",
    "accelerate_fsdp2_load_full_state_dict",
    "areal_fsdp2_load_full_state_dict",
    "from_pretrained",
    "fsdp2_load_full_state_dict",
    "load_checkpoint",
    "save_pretrained",
    "sync_weights",
]
