"""Sources the reader can pack from: a checkpoint on disk (Checkpoint) or a
state dict already in memory (StateDictSource), behind the same interface:
``info(key)``, ``tensors``, ``engine`` and ``files``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import DTypeMismatchError, TensorNotFoundError
from . import _native
from .checkpoint import Checkpoint, LazyCheckpoint, TensorInfo
from .copy_ops import ST_DTYPES
from .remote import RemoteCheckpoint, as_remote, is_remote

STATE_DICT = "<state_dict>"


class StateDictSource:
    """A dict of tensors as a packing source: ops read straight from each
    tensor's memory (file index -1). Non-contiguous or non-CPU tensors are
    made contiguous on the CPU one at a time, when first packed.

    Args:
        state: name -> tensor (DTensors are not accepted: this is a full state).
        threads: native copy threads.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], threads: int | None = None) -> None:
        self.state = dict(state)
        self.files: list = []
        self.engine = _native.CopyEngine(threads or 0)
        self.path = STATE_DICT
        self._held: dict[str, torch.Tensor] = {}
        for name, t in self.state.items():
            if t.dtype not in ST_DTYPES:
                raise DTypeMismatchError(f"unsupported dtype {t.dtype}", STATE_DICT, name)

    def _cpu(self, name: str) -> torch.Tensor:
        t = self.state[name]
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if t.device.type == "cpu" and t.is_contiguous():
            return t
        held = self._held.get(name)
        if held is None:
            # Kept until release(): ops of the pending batch point into it.
            held = self._held[name] = t.detach().to("cpu").contiguous()
        return held

    def release(self) -> None:
        """Drops converted copies once the batch that used them has run."""
        self._held = {}

    def info(self, name: str) -> TensorInfo:
        if name not in self.state:
            raise TensorNotFoundError("not in the state dict", STATE_DICT, name)
        t = self._cpu(name)
        return TensorInfo(
            name,
            ST_DTYPES[t.dtype],
            tuple(t.shape),
            STATE_DICT,
            -1,
            0,
            t.data_ptr(),
            t.numel() * t.element_size(),
        )

    def __contains__(self, name: object) -> bool:
        return name in self.state

    @property
    def tensors(self) -> list[TensorInfo]:
        """The table without materialising anything (begin is filled by ``info``)."""
        out = []
        for name, t in self.state.items():
            out.append(
                TensorInfo(
                    name,
                    ST_DTYPES[t.dtype],
                    tuple(t.shape),
                    STATE_DICT,
                    -1,
                    0,
                    0,
                    t.numel() * t.element_size(),
                )
            )
        return out

    def read_region(self, name: str, box: list[tuple[int, int]]) -> torch.Tensor:
        t = self._cpu(name)
        return t[tuple(slice(a, b) for a, b in box)]


Source = Checkpoint | StateDictSource


def as_source(
    obj: object,
    read_mode: str = "auto",
    threads: int | None = None,
    drop_cache: bool = False,
    direct_io: bool | None = None,
) -> Source:
    """A path (an object store URL or ``RemotePath`` included), Checkpoint, lazy checkpoint or
    dict of tensors as a packing source (``read_mode``,
    ``drop_cache`` and ``direct_io``: see ``Checkpoint``)."""
    if isinstance(obj, (Checkpoint, StateDictSource)):
        return obj
    if isinstance(obj, Mapping):
        return StateDictSource(obj, threads)
    if isinstance(obj, LazyCheckpoint):
        return obj.open(read_mode, threads, drop_cache, direct_io)
    if is_remote(obj):
        return RemoteCheckpoint(as_remote(obj), threads)
    return Checkpoint(
        obj,  # type: ignore[arg-type]
        mode=read_mode,
        threads=threads,
        drop_cache=drop_cache,
        direct_io=direct_io,
    )
