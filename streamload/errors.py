"""Named errors. Each carries the file and tensor it concerns and, once the
distributed loader has seen it, the rank that failed."""

from __future__ import annotations


class StreamloadError(Exception):
    """Base class of every error streamload raises on purpose.

    Args:
        reason: what went wrong, in words.
        file: the checkpoint file concerned, if any.
        tensor: the tensor (or parameter) concerned, if any.
        rank: the rank where the failure happened, if known.
    """

    def __init__(
        self, reason: str, file: str | None = None, tensor: str | None = None, rank: int | None = None
    ) -> None:
        self.reason = reason
        self.file = file
        self.tensor = tensor
        self.rank = rank
        super().__init__(reason, file, tensor)

    def __str__(self) -> str:
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.file:
            parts.append(str(self.file))
        if self.tensor:
            parts.append(f"tensor '{self.tensor}'")
        prefix = ": ".join(parts)
        return f"{prefix}: {self.reason}" if prefix else self.reason

    def __reduce__(self):  # keep the fields when pickled across ranks
        return (self.__class__, (self.reason, self.file, self.tensor, self.rank))


class CheckpointError(StreamloadError):
    """The checkpoint on disk is unusable."""


class HeaderError(CheckpointError):
    """A safetensors header is malformed or lies about its data."""


class CheckpointFileError(CheckpointError):
    """A checkpoint file cannot be opened or read, or changed while open."""


class CheckpointIndexError(CheckpointError):
    """model.safetensors.index.json is malformed or inconsistent."""


class UnsafePathError(CheckpointError):
    """An index entry or file name leaves the checkpoint directory."""


class TensorNotFoundError(CheckpointError, KeyError):
    """A tensor name is not in the checkpoint."""

    def __str__(self) -> str:
        return StreamloadError.__str__(self)


class CopyOpError(StreamloadError):
    """A native copy op failed its bounds or dtype checks (nothing was written)."""


class ModelMismatchError(StreamloadError):
    """Checkpoint and model disagree (shape, dtype or keys)."""


class ShapeMismatchError(ModelMismatchError):
    """A tensor's shape in the checkpoint differs from the model's parameter."""


class DTypeMismatchError(ModelMismatchError):
    """A tensor's dtype cannot be converted to the parameter's dtype."""


class KeyMismatchError(ModelMismatchError):
    """Missing or unexpected keys under strict loading.

    Attributes:
        missing: model keys the checkpoint does not provide.
        unexpected: checkpoint keys the model does not use.
    """

    def __init__(
        self,
        reason: str,
        file: str | None = None,
        tensor: str | None = None,
        rank: int | None = None,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
    ) -> None:
        super().__init__(reason, file, tensor, rank)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])

    def __reduce__(self):
        return (
            self.__class__,
            (self.reason, self.file, self.tensor, self.rank, self.missing, self.unexpected),
        )


class PlacementError(ModelMismatchError):
    """A parameter's DTensor placements cannot be filled exactly (Partial, an
    unknown placement type, a non-default shard order, or specs that differ
    between ranks); raised on every rank before the first weight byte."""


class TieError(StreamloadError):
    """Tied parameters are not the same object after loading."""


class RemoteRankError(StreamloadError):
    """Another rank failed; raised on the ranks that were waiting for it."""


class MappingError(ModelMismatchError):
    """A key mapping (``load_checkpoint(mapping=...)``, e.g. torchtitan's state-dict
    adapter) that streamload cannot express as region algebra exactly, or whose
    derived layout differs from what the mapping itself produces; raised on every
    rank before the first weight byte."""
