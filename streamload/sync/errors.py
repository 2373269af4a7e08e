"""The weight sync's named errors (raised alike on every trainer rank of a sync)."""

from __future__ import annotations

from typing import Any

from ..errors import KeyMismatchError, StreamloadError


class SyncError(StreamloadError):
    """A weight sync failed; raised on every trainer rank, naming the rank where it failed."""


class EngineMismatchError(SyncError, KeyMismatchError):
    """The engine's model does not take the trainer's weights: hub names or shapes differ.

    Takes ``KeyMismatchError``'s arguments, and ``shapes``.

    Attributes:
        missing: hub tensors the engine's model needs that the trainer does not have.
        unexpected: hub tensors the trainer has that the engine's model does not take.
        shapes: name -> (trainer shape, engine shape) where both have the tensor.
    """

    def __init__(
        self,
        *args: Any,
        shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.shapes = dict(shapes or {})  # pickled with the fields, in __dict__ (see __reduce__)


class EngineDeadError(SyncError):
    """The inference engine a sync feeds is gone (shut down, crashed, or its process exited)."""
