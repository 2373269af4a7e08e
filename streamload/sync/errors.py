"""The weight sync's named errors (raised alike on every trainer rank of a sync)."""

from __future__ import annotations

from ..errors import ModelMismatchError, StreamloadError


class SyncError(StreamloadError):
    """A weight sync failed; raised on every trainer rank, naming the rank where it failed."""


class EngineMismatchError(SyncError, ModelMismatchError):
    """The engine's model does not take the trainer's weights: hub names or shapes differ.

    Attributes:
        missing: hub tensors the engine's model needs that the trainer does not have.
        unexpected: hub tensors the trainer has that the engine's model does not take.
        shapes: name -> (trainer shape, engine shape) where both have the tensor.
    """

    def __init__(
        self,
        reason: str,
        file: str | None = None,
        tensor: str | None = None,
        rank: int | None = None,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        *,
        hint: str | None = None,
    ) -> None:
        super().__init__(reason, file, tensor, rank, hint=hint)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])
        self.shapes = dict(shapes or {})

    def __reduce__(self):  # keep the lists when pickled across ranks
        return (
            self.__class__,
            (self.reason, self.file, self.tensor, self.rank, self.missing, self.unexpected, self.shapes),
            self.__dict__,
        )


class EngineDeadError(SyncError):
    """The inference engine a sync feeds is gone (shut down, crashed, or its process exited)."""
