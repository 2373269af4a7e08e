"""Named errors. Each carries the file and tensor it concerns, once the
distributed loader has seen it the rank that failed, and for the errors a user
meets first a hint: one line that says what to do next."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path


class StreamloadError(Exception):
    """Base class of every error streamload raises on purpose.

    Args:
        reason: what went wrong, in words.
        file: the checkpoint file concerned, if any.
        tensor: the tensor (or parameter) concerned, if any.
        rank: the rank where the failure happened, if known.
        hint: what to do next, in one line (printed on a line of its own).
    """

    def __init__(
        self,
        reason: str,
        file: str | None = None,
        tensor: str | None = None,
        rank: int | None = None,
        *,
        hint: str | None = None,
    ) -> None:
        self.reason = reason
        self.file = file
        self.tensor = tensor
        self.rank = rank
        self.hint = hint
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
        text = f"{prefix}: {self.reason}" if prefix else self.reason
        return f"{text}\n  hint: {self.hint}" if self.hint else text

    def __reduce__(self):  # keep the fields (hint included) when pickled across ranks
        return (self.__class__, (self.reason, self.file, self.tensor, self.rank), self.__dict__)


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
        *,
        hint: str | None = None,
    ) -> None:
        super().__init__(reason, file, tensor, rank, hint=hint)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])

    def __reduce__(self):
        return (
            self.__class__,
            (self.reason, self.file, self.tensor, self.rank, self.missing, self.unexpected),
            self.__dict__,
        )


class PlacementError(ModelMismatchError):
    """A parameter's DTensor placements cannot be filled exactly (Partial, an
    unknown placement type, a non-default shard order, or specs that differ
    between ranks), or the model's device cannot travel on the load's group (a
    CPU model over part of an NCCL world); raised on every rank before the first
    weight byte."""


class TieError(StreamloadError):
    """Tied parameters are not the same object after loading."""


class RemoteRankError(StreamloadError):
    """Another rank failed; raised on the ranks that were waiting for it."""


class PeerError(StreamloadError):
    """A peer rank is missing from a call: it never arrived, or it was lost during it.

    Attributes:
        ranks: the group ranks concerned (absent, lost or interrupted).
        step: the entry point (``load_checkpoint``, ``save_pretrained``, ...).
    """

    def __init__(
        self,
        reason: str,
        file: str | None = None,
        tensor: str | None = None,
        rank: int | None = None,
        *,
        ranks: list[int] | None = None,
        step: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(reason, file, tensor, rank, hint=hint)
        self.ranks = list(ranks or [])
        self.step = step


class RankAbsentError(PeerError, TimeoutError):
    """Ranks of the group did not call the entry point within ``timeout`` seconds (they raised
    or returned before it, or are stuck); no collective was started, nothing was loaded or written."""

    def __str__(self) -> str:
        return StreamloadError.__str__(self)


class RankLostError(PeerError):
    """Ranks left during the call (killed, interrupted, their host gone); the survivors name them.
    The process group is unusable afterwards: destroy it and restart."""


class OptionMismatchError(StreamloadError, ValueError):
    """The ranks called different entry points, or passed different values of an option that
    every rank must pass alike (``src_rank=``, ``readers=``, ``dtype=``, ...)."""

    def __str__(self) -> str:
        return StreamloadError.__str__(self)


class SaveError(StreamloadError):
    """A save failed on some rank (``rank`` names it); raised on every rank of the save,
    after the temporary directory was removed: the target directory was left as it was."""


class MappingError(ModelMismatchError):
    """A key mapping (``load_checkpoint(mapping=...)``, e.g. torchtitan's state-dict
    adapter) that streamload cannot express as region algebra exactly, or whose
    derived layout differs from what the mapping itself produces; raised on every
    rank before the first weight byte."""


# -- hints: the line that says what to do next -------------------------------------

_HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_PICKLED = (".bin", ".pt", ".pth", ".ckpt")


def looks_like_hub_id(path: str | os.PathLike) -> bool:
    """True for ``"org/name"`` that is not a local path: a Hugging Face Hub repo id."""
    text = os.fspath(path)
    parts = text.split("/")
    return (
        len(parts) == 2
        and all(_HUB_PART.fullmatch(p) for p in parts)
        and not text.endswith(".safetensors")
        and not os.path.exists(text)
    )


def missing_path_hint(path: str | os.PathLike) -> str:
    """What to do when ``path`` names nothing on this machine."""
    text = os.fspath(path)
    if looks_like_hub_id(text):
        return (
            f"'{text}' looks like a Hugging Face Hub id; streamload reads local files: download it first "
            f"with `hf download {text} --local-dir DIR` and pass DIR"
        )
    if text.startswith("~"):
        return "'~' is not expanded: pass os.path.expanduser(path)"
    return "pass a local directory holding config.json and the *.safetensors files (or one .safetensors file)"


def no_safetensors_hint(root: str | os.PathLike) -> str:
    """What to do with a directory that holds no ``*.safetensors`` file."""
    base = Path(root)
    pickled = sorted(p.name for p in base.iterdir() if p.suffix in _PICKLED) if base.is_dir() else []
    if pickled:
        return (
            f"found {pickled[0]}, but streamload reads safetensors only: convert once with `python -c "
            f"\"from transformers import AutoModelForCausalLM as M; M.from_pretrained('{base}')"
            f".save_pretrained('{base}-safetensors')\"` and pass {base}-safetensors"
        )
    # The hub cache root or a parent directory: the files sit a level or two below.
    for pattern in ("*/*.safetensors", "*/*/*.safetensors"):
        found = next(iter(sorted(base.glob(pattern))), None)
        if found is not None:
            return f"found safetensors files in {found.parent}: pass that directory"
    return "pass the directory that holds the *.safetensors files (download them with `hf download REPO --local-dir DIR`)"


def missing_file_hint() -> str:
    """What to do when model.safetensors.index.json names a file that is not there."""
    return (
        "the download is incomplete: fetch the missing file again (`hf download REPO --local-dir DIR` "
        "resumes) or pass the directory that holds every file the index names"
    )


def _directory(checkpoint: str | os.PathLike | None) -> str:
    """The checkpoint directory as a hint names it: ``DIR`` when unknown."""
    if checkpoint is None or os.fspath(checkpoint).startswith("<"):  # "<state_dict>": no directory
        return "DIR"
    path = Path(checkpoint)
    return str(path.parent if path.suffix == ".safetensors" else path)


def rebuild_hint(checkpoint: str | os.PathLike | None = None) -> str:
    """What to do when the model was built from another config than the checkpoint's.

    Args:
        checkpoint: the checkpoint directory, or one of its files, if known.
    """
    where = _directory(checkpoint)
    return (
        f"build the model from this checkpoint's own config.json (AutoConfig.from_pretrained('{where}'), "
        f"or streamload.from_pretrained('{where}'))"
    )


def names(keys: Sequence[str], shown: int = 5) -> str:
    """The first ``shown`` of ``keys``, and how many more there are."""
    head = ", ".join(f"'{k}'" for k in keys[:shown])
    more = len(keys) - shown
    return f"{head}, and {more} more" if more > 0 else head


def key_mismatch_hint(
    missing: Sequence[str], unexpected: Sequence[str], checkpoint: str | os.PathLike | None = None
) -> str:
    """What to do about missing and unexpected keys under strict loading (``checkpoint``: its path)."""
    if missing and unexpected:
        return (
            "the model is not this checkpoint's (architecture, class or config): build the class config.json "
            f"names in \"architectures\" from that config (AutoConfig.from_pretrained('{_directory(checkpoint)}')), "
            "or pass strict=False to load what matches"
        )
    if missing:
        return "pass strict=False to load the rest (LoadReport.missing_keys lists what the checkpoint did not fill)"
    return (
        "pass unexpected='ignore' to skip them (e.g. a pipeline stage holding some layers), or strict=False"
    )


def key_mismatch_reason(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """One line: how many keys are missing and unexpected, and the first of each."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys (in the model, not in the checkpoint): {names(missing)}")
    if unexpected:
        parts.append(
            f"{len(unexpected)} unexpected keys (in the checkpoint, not in the model): {names(unexpected)}"
        )
    return "; ".join(parts)


HF_MODULES = ("transformers", "accelerate", "huggingface_hub")


def hf_missing(feature: str, exc: ImportError) -> ImportError:
    """The ImportError to raise when ``feature`` needs the ``[hf]`` extra and ``exc`` says it is
    absent; ``exc`` itself when it is about another module (a broken install is not this)."""
    if (exc.name or "").split(".")[0] not in HF_MODULES:
        return exc
    return ModuleNotFoundError(
        f"{feature} needs transformers and accelerate ({exc})\n  hint: pip install 'streamload[hf]'",
        name=exc.name,
    )
