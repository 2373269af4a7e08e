"""A safetensors checkpoint on disk: one file, a directory with an index, or
a directory of shards. Headers are validated natively; nothing is written."""

from __future__ import annotations

import difflib
import json
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    CheckpointError,
    CheckpointFileError,
    CheckpointIndexError,
    DTypeMismatchError,
    TensorNotFoundError,
    UnsafePathError,
    missing_file_hint,
    missing_path_hint,
    no_safetensors_hint,
)
from . import _native, cold
from .copy_ops import ITEMSIZE, ST_DTYPES, TORCH_DTYPES, OpBatch, can_convert, contiguous_strides

INDEX_NAME = "model.safetensors.index.json"
# A region as callers spell it: per dim a slice or a [start, stop) pair.
RegionSpec = Sequence["slice | tuple[int, int]"]


@dataclass(frozen=True)
class TensorInfo:
    """One row of the tensor table.

    Attributes:
        name: tensor key in the checkpoint.
        dtype: safetensors dtype name (``"BF16"``, ...).
        shape: tensor shape.
        file: path of the file holding it.
        file_index: index of that file in ``Checkpoint.files``.
        offset: absolute byte offset of its data within the file.
        begin: byte offset within the file's data section.
        nbytes: size in bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    file_index: int
    offset: int
    begin: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the file's elements; DTypeMismatchError for the
        sub-byte dtypes (F4, F6_*), which torch has no element type for."""
        try:
            return TORCH_DTYPES[self.dtype]
        except KeyError:
            raise DTypeMismatchError(
                f"{self.dtype} has no torch element type: Checkpoint.read_bytes gives its bytes",
                self.file,
                self.name,
            ) from None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _safe_member(root: Path, name: str, where: str) -> Path:
    """Resolves ``name`` inside ``root`` or raises UnsafePathError.

    The name itself must stay inside the directory (not absolute, no ``..``, no
    directory on the way that is a symlink leading out), but the file it names may be a
    symlink to anywhere: the Hugging Face hub cache keeps ``snapshots/<rev>/<file>`` as
    links to ``../../blobs/<hash>``, and transformers loads them. The target must be a
    regular file (``_regular_file``).
    """
    if not name or os.path.isabs(name) or name.startswith(("/", "\\")):
        raise UnsafePathError(f"absolute or empty path {name!r} in {where}", str(root / INDEX_NAME))
    parts = Path(name).parts
    if ".." in parts:
        raise UnsafePathError(
            f"path {name!r} in {where} leaves the checkpoint directory", str(root / INDEX_NAME)
        )
    candidate = root / name
    real_root = root.resolve()
    real_dir = candidate.parent.resolve()
    if real_dir != real_root and real_root not in real_dir.parents:
        raise UnsafePathError(
            f"path {name!r} in {where} lies in {real_dir}, outside the checkpoint directory "
            "(a directory symlink?)",
            str(candidate),
        )
    _regular_file(candidate, where)
    return candidate


def _regular_file(path: Path, where: str | None = None) -> None:
    """Raises CheckpointFileError unless ``path`` (after symlinks) is a regular file.

    Checked before anything opens it: opening a FIFO blocks until a writer comes (a hang,
    not an error), and a device or directory is no checkpoint.
    """
    try:
        st = path.stat()  # follows symlinks: the target is what will be read
    except OSError as exc:
        what = "a dangling symlink" if path.is_symlink() else "missing"
        named = f" (named by {where})" if where else ""
        raise CheckpointFileError(
            f"checkpoint file is {what}{named}: {exc.strerror}", str(path), hint=missing_file_hint()
        ) from None
    if not stat.S_ISREG(st.st_mode):
        target = f" (a symlink to {path.resolve()})" if path.is_symlink() else ""
        raise CheckpointFileError(f"not a regular file{target}", str(path))


def resolve_files(path: str | os.PathLike) -> tuple[list[Path], dict[str, str] | None]:
    """Lists the safetensors files of a checkpoint and its weight map, if indexed.

    Args:
        path: a ``.safetensors`` file or a checkpoint directory.

    Returns:
        (files in load order, {tensor name: file name} or None without an index).
    """
    root = Path(path)
    if root.is_file():
        return [root], None
    if not root.is_dir():
        raise CheckpointError("no such checkpoint file or directory", str(root), hint=missing_path_hint(path))
    index_path = root / INDEX_NAME
    if index_path.exists() or index_path.is_symlink():
        _regular_file(index_path)  # the hub cache links it to a blob too
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointIndexError(f"malformed index: {exc}", str(index_path)) from exc
        names: dict[str, None] = {}  # each file checked once, however many tensors it holds
        for tensor, fname in weight_map.items():
            if not isinstance(fname, str):
                raise CheckpointIndexError(f"file name is not a string: {fname!r}", str(index_path), tensor)
            if fname not in names:
                _safe_member(root, fname, f"the index entry for '{tensor}'")
                names[fname] = None
        return [root / n for n in sorted(names)], {k: str(v) for k, v in weight_map.items()}
    files = sorted(p for p in root.iterdir() if p.suffix == ".safetensors")
    for f in files:
        _safe_member(root, f.name, "the checkpoint directory")
    if not files:
        raise CheckpointError(
            "no .safetensors files in the checkpoint directory", str(root), hint=no_safetensors_hint(root)
        )
    return files, None


class Checkpoint:
    """A safetensors checkpoint opened read-only.

    Args:
        path: a single ``.safetensors`` file, or a directory holding
            ``model.safetensors.index.json`` or several ``.safetensors`` files.
        mode: ``"mmap"``, ``"pread"``, ``"cold"`` (explicit large aligned reads for
            files not in the page cache: buffered, or O_DIRECT with ``drop_cache`` or
            ``direct_io=True``; see ``cold.ColdEngine``) or ``"auto"``: cold when less than half of the
            files' pages are cached (``mincore``), else mapped (pread where mmap fails).
        threads: copy threads (default: the CPUs available).
        drop_cache: cold reads drop what they read from the page cache behind them.
        direct_io: cold reads with O_DIRECT (True) or buffered (False); None: the default
            policy (see ``load_checkpoint`` and docs/options.md).

    Attributes:
        read_mode: the mode in use: ``"mmap"``, ``"pread"`` or ``"cold"``.

    Example:
        >>> ckpt = Checkpoint("ckpt_dir")
        >>> w = ckpt.read("model.embed_tokens.weight", dtype=torch.float32)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        mode: str = "auto",
        threads: int | None = None,
        drop_cache: bool = False,
        direct_io: bool | None = None,
    ) -> None:
        self.path = Path(path)
        self.mode = mode
        paths, weight_map = resolve_files(self.path)
        chosen = cold.choose_read_mode(mode, paths)
        # Cold reads go around the mapping, but shards that are views of the files need it
        # (their pages are prefetched at the disk's speed); drop_cache leaves no pages to view.
        native_mode = ("pread" if drop_cache else "auto") if chosen == "cold" else chosen
        self.files = [_native.SafetensorsFile(str(p), native_mode) for p in paths]
        self.engine: Any = _native.CopyEngine(threads or 0)
        if chosen == "cold":
            self.engine = cold.ColdEngine(self.engine, self.files, drop_cache=drop_cache, direct_io=direct_io)
        self.read_mode = (
            chosen if chosen != "auto" else ("mmap" if all(f.mapped for f in self.files) else "pread")
        )
        resolved: dict[str, Path] = {}  # index file name -> real path, resolved once

        def real(fname: str) -> Path:
            if fname not in resolved:
                resolved[fname] = (self.path / fname).resolve()
            return resolved[fname]

        here = {f.path: Path(f.path).resolve() for f in self.files}
        self._fill_table(weight_map, lambda fname, f: real(fname) == here[f.path])

    def use_threads(self, threads: int) -> bool:
        """Copies with ``threads`` native threads from now on, over the files already open: a new
        plain copy engine. False (nothing changed) for a cold read's engine, which keeps its own."""
        if not isinstance(self.engine, _native.CopyEngine):
            return False
        self.engine = _native.CopyEngine(threads)
        return True

    def _fill_table(self, weight_map: dict[str, str] | None, holds: Callable[[str, Any], bool]) -> None:
        """The tensor table from the opened files' headers: a tensor the index maps to another
        file is skipped there (``holds(index file name, file)`` is False), one in two files is an
        error, and so is an index entry no file holds."""
        self.metadata: dict[str, dict[str, str]] = {}
        self._table: dict[str, TensorInfo] = {}
        for i, f in enumerate(self.files):
            self.metadata[f.path] = dict(f.metadata)
            for name, dtype, shape, begin, end in f.tensors:
                if weight_map is not None and weight_map.get(name) is not None:
                    if not holds(weight_map[name], f):
                        continue  # the index names another file for it
                if name in self._table:
                    raise CheckpointError(
                        f"tensor is in two files ({self._table[name].file} and {f.path})", f.path, name
                    )
                self._table[name] = TensorInfo(
                    name, dtype, tuple(shape), f.path, i, f.data_start + begin, begin, end - begin
                )
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self._table:
                    raise CheckpointIndexError(
                        f"the index maps it to {fname}, which does not hold it", self._member(fname), name
                    )

    def _member(self, fname: str) -> str:
        """The path of the index's file name ``fname``, for messages."""
        return str(self.path / fname)

    @staticmethod
    def lazy(
        path: str | os.PathLike,
        mode: str | None = None,
        threads: int | None = None,
        drop_cache: bool | None = None,
    ) -> LazyCheckpoint:
        """A checkpoint that streamload opens inside its agreement, not here.

        ``Checkpoint(path)`` opens the files at once: built on rank 0 before the load, a
        missing or corrupt checkpoint raises on rank 0 alone while the other ranks wait in
        the load's first collective. The lazy handle opens nothing until the loader does,
        on the reader rank, inside the agreement, so the failure is a named error on every
        rank. Any argument left None takes the loader's own setting.

        Args:
            path: as ``Checkpoint``.
            mode, threads, drop_cache: as ``Checkpoint``; None: the loader's.

        Returns:
            A path-like handle: pass it wherever streamload takes a checkpoint path.

        Example:
            >>> full_state = streamload.Checkpoint.lazy(path) if rank == 0 else {}
            >>> streamload.fsdp2_load_full_state_dict(model, full_state, mesh)
        """
        return LazyCheckpoint(path, mode, threads, drop_cache)

    # -- table ---------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def keys(self) -> list[str]:
        return list(self._table)

    def info(self, name: str) -> TensorInfo:
        """Returns the table row of ``name`` or raises TensorNotFoundError."""
        try:
            return self._table[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._table, n=1)
            near = f"did you mean '{close[0]}'? " if close else ""
            hint = f"{near}Checkpoint.keys() lists every name"
            raise TensorNotFoundError("not in the checkpoint", str(self.path), name, hint=hint) from None

    @property
    def tensors(self) -> list[TensorInfo]:
        """The tensor table, in file then header order."""
        return list(self._table.values())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._table.values())

    # -- reads ---------------------------------------------------------------
    def read(
        self, name: str, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Reads a whole tensor.

        Args:
            name: tensor key.
            out: contiguous CPU tensor of the same shape to fill (its dtype wins).
            dtype: result dtype when ``out`` is not given (default: the file's).

        Returns:
            The tensor (``out`` when given).
        """
        info = self.info(name)
        return self.read_region(name, [(0, s) for s in info.shape], out=out, dtype=dtype)

    def read_bytes(self, name: str) -> torch.Tensor:
        """Reads a tensor's raw bytes, whatever its dtype (F4 and F6_* included).

        Args:
            name: tensor key.

        Returns:
            A uint8 tensor of the tensor's bytes, as stored.

        Example:
            >>> packed = ckpt.read_bytes("model.layers.0.mlp.experts.down_proj_blocks")
        """
        info = self.info(name)
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        self.files[info.file_index].read_into(info.begin, info.nbytes, out.data_ptr(), info.nbytes)
        return out

    def read_region(
        self, name: str, box: RegionSpec, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Reads the sub-box ``box`` (one slice or (start, stop) per dim) of a tensor."""
        info = self.info(name)
        starts, sizes = _normalize_box(box, info)
        target = out
        if target is None:
            target = torch.empty(sizes, dtype=dtype or info.torch_dtype)
        self.read_into({name: (target, starts)})
        return target

    def read_into(self, targets: Mapping[str, torch.Tensor | tuple[torch.Tensor, Sequence[int]]]) -> int:
        """Fills many preallocated tensors in one native call.

        Args:
            targets: name -> contiguous CPU tensor (whole tensor), or
                name -> (tensor, region start per dim) for a sub-box the tensor's shape.

        Returns:
            Bytes read from the checkpoint.
        """
        batch = OpBatch()
        for name, target in targets.items():
            info = self.info(name)
            if isinstance(target, tuple):
                tensor, starts = target
            else:
                tensor, starts = target, [0] * len(info.shape)
            self._add_region_op(batch, info, tensor, list(starts))
        return batch.execute(self.engine, self.files)

    def _add_region_op(self, batch: OpBatch, info: TensorInfo, out: torch.Tensor, starts: list[int]) -> None:
        shape = tuple(out.shape)
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"out for '{info.name}' must be a contiguous CPU tensor")
        if len(shape) != len(info.shape) or any(
            s < 0 or s + n > d for s, n, d in zip(starts, shape, info.shape, strict=True)
        ):
            raise CheckpointError(
                f"region start {starts} size {list(shape)} does not fit shape {list(info.shape)}",
                info.file,
                info.name,
            )
        dst_dtype = ST_DTYPES.get(out.dtype)
        if dst_dtype is None or not can_convert(info.dtype, dst_dtype):
            raise DTypeMismatchError(f"cannot read {info.dtype} into {out.dtype}", info.file, info.name)
        src_strides = contiguous_strides(info.shape)
        batch.add(
            file=info.file_index,
            src=info.begin,
            src_nbytes=info.nbytes,
            src_dtype=info.dtype,
            dst=out,
            dst_dtype=dst_dtype,
            shape=shape,
            src_strides=src_strides,
            dst_strides=contiguous_strides(shape),
            src_offset=sum(s * st for s, st in zip(starts, src_strides, strict=True)),
        )

    def check_unchanged(self) -> None:
        """Raises CheckpointFileError if any file shrank since it was opened."""
        for f in self.files:
            f.check_unchanged()


class LazyCheckpoint(os.PathLike):
    """A checkpoint path plus how to open it; opened by the loader (``Checkpoint.lazy``).

    It is a path (``os.fspath`` gives the directory), so every reader mode, the file
    identity check and ``from_pretrained``'s config read treat it as one.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        mode: str | None = None,
        threads: int | None = None,
        drop_cache: bool | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.mode = mode
        self.threads = threads
        self.drop_cache = drop_cache

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"Checkpoint.lazy({self.path!r}, mode={self.mode!r})"

    def open(
        self,
        mode: str = "auto",
        threads: int | None = None,
        drop_cache: bool = False,
        direct_io: bool | None = None,
    ) -> Checkpoint:
        """Opens it: the handle's own settings win over the loader's (the arguments).

        Args:
            mode, threads, drop_cache, direct_io: the loader's settings.

        Returns:
            The open Checkpoint.
        """
        return Checkpoint(
            self.path,
            mode=self.mode or mode,
            threads=self.threads if self.threads is not None else threads,
            drop_cache=self.drop_cache if self.drop_cache is not None else drop_cache,
            direct_io=direct_io,
        )


def _normalize_box(box: RegionSpec, info: TensorInfo) -> tuple[list[int], list[int]]:
    if len(box) != len(info.shape):
        raise CheckpointError(f"box has {len(box)} dims, tensor has {len(info.shape)}", info.file, info.name)
    starts, sizes = [], []
    for b, dim in zip(box, info.shape, strict=True):
        if isinstance(b, slice):
            start, stop, step = b.indices(dim)
            if step != 1:
                raise CheckpointError("strided boxes are not supported", info.file, info.name)
        else:
            start, stop = int(b[0]), int(b[1])
        if not 0 <= start <= stop <= dim:
            raise CheckpointError(f"box {box} is outside shape {list(info.shape)}", info.file, info.name)
        starts.append(start)
        sizes.append(stop - start)
    return starts, sizes


__all__ = ["INDEX_NAME", "ITEMSIZE", "Checkpoint", "LazyCheckpoint", "TensorInfo", "resolve_files"]
