"""Output layout: the checkpoint files a save writes, planned from the model alone.

transformers' own save path is run on META tensors of the model's GLOBAL
shapes (a DTensor contributes ``torch.empty(global shape, device="meta")``):
``remove_tied_weights_from_state_dict`` keeps one name per tie group,
``revert_weight_conversion`` turns fused parameters back into the hub's
per-expert tensors, and huggingface_hub's shard splitter assigns files by
``max_shard_size``. Hub names, shapes, dtypes, file assignment and the index
are therefore transformers' own, with no byte of weight data anywhere.

The splitter groups tensors that share storage (transformers' reverted
experts are views of one fused tensor and land in the file of the first);
meta views keep that identity in ``._base``, so the grouping is the same.

Every safetensors header is then serialized exactly as the ``safetensors``
library does (tensors sorted by dtype, widest first, then by name; compact
JSON; padded with spaces to 8 bytes), which gives every tensor's absolute
file offset. The result is pure and deterministic: every rank computes the
same layout without communicating.
"""

from __future__ import annotations

import copy
import json
import struct
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import SaveError
from ..io.copy_ops import ITEMSIZE, ST_DTYPES, TORCH_DTYPES
from ..model.hf import unsharded_classes

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
FILE_PATTERN = "model{suffix}.safetensors"
HEADER_METADATA = {"format": "pt"}

# safetensors' Dtype enum order (its header lists tensors by dtype, widest first, then by
# name); measured against safetensors' own ``save`` in tests/test_save.py.
_DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
_DTYPE_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}


@dataclass(frozen=True)
class HubTensor:
    """One tensor of the output checkpoint.

    Attributes:
        name: hub key (as transformers' ``save_pretrained`` names it).
        dtype: safetensors dtype name (``"BF16"``).
        shape: global shape.
        file: output file name.
        offset: absolute byte offset of its first element in ``file``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


@dataclass(frozen=True)
class OutputFile:
    """One safetensors file: its header bytes (length prefix included) and total size."""

    name: str
    header: bytes
    size: int
    tensors: tuple[str, ...]  # in data order


@dataclass
class Layout:
    """The whole output: tensors, files and the index (None when one file).

    Attributes:
        tensors: hub key -> HubTensor, in transformers' state-dict order.
        files: the safetensors files in name order.
        index: the bytes of ``model.safetensors.index.json``, or None for one file.
        total_size: the index's ``metadata.total_size``.
    """

    tensors: dict[str, HubTensor]
    files: list[OutputFile]
    index: bytes | None
    total_size: int

    @property
    def table(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """The layout as a checkpoint tensor table (key -> (dtype, shape, file)), the loader's form."""
        return {k: (t.dtype, t.shape, t.file) for k, t in self.tensors.items()}


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a save writes: ``model.state_dict()`` (tied names share one object),
    less transformers' ``_keys_to_ignore_on_save``.

    Args:
        model: any module (FSDP2 / DTensor parameters included).

    Returns:
        name -> the model's parameter or persistent buffer (not detached: ties keep identity).

    Example:
        >>> s = model_state(model)
        >>> s["lm_head.weight"] is s["model.embed_tokens.weight"]  # a tied model
        True
    """
    state = dict(model.state_dict(keep_vars=True))
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    return state


def _is_transformers(model: nn.Module) -> bool:
    if "transformers.modeling_utils" not in sys.modules:
        return False
    from transformers.modeling_utils import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The saved dtype of ``t``: ``dtype`` for floating-point tensors when given (as
    ``model.to(dtype)`` casts), else its own.

    Example:
        >>> out_dtype(torch.zeros(2, dtype=torch.int64), torch.bfloat16)
        torch.int64
    """
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _meta_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """One meta tensor of the global shape per model tensor; tied names share it."""
    by_id: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        meta = by_id.get(id(t))
        if meta is None:
            meta = torch.empty(tuple(t.shape), dtype=out_dtype(t, dtype), device="meta")
            by_id[id(t)] = meta
        out[name] = meta
    return out


def _untie(meta: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """One name per tie group, the one transformers keeps."""
    if _is_transformers(model):
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        return dict(remove_tied_weights_from_state_dict(meta, model))  # type: ignore[arg-type]
    seen: set[int] = set()
    out = {}
    for name, t in meta.items():  # a plain module: the first name of each tensor
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


@contextmanager
def _as_loaded(model: nn.Module) -> Iterator[None]:
    """Within the block ``model`` carries the conversions transformers' ``from_pretrained``
    attaches (``_weight_conversions``) when it has none.

    transformers saves a model it loaded in natural key order (its reverse conversion sorts
    the state dict) but a model it never loaded in module order; a model streamload loaded
    is saved as transformers saves one it loaded itself.
    """
    if getattr(model, "_weight_conversions", None) is not None:
        yield
        return
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    mapping = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
    model._weight_conversions = [m for m in mapping if not isinstance(m, PrefixChange)]  # type: ignore[assignment]
    try:
        yield
    finally:
        delattr(model, "_weight_conversions")


def hub_state(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """transformers' save-time state dict of ``model``, as meta tensors of the global shapes.

    Args:
        model: the model (sharded or not).
        dtype: optional cast of floating-point tensors.

    Returns:
        hub key -> meta tensor. A tensor transformers' reverse ops leave as a view keeps
        its base in ``._base`` (the storage the shard splitter groups by).

    Raises:
        SaveError: transformers' reverse conversion cannot run on meta tensors.

    Example:
        >>> hub_state(qwen3_moe_model)["model.layers.0.mlp.experts.0.gate_proj.weight"].shape
        torch.Size([16, 32])
    """
    meta = _untie(_meta_state(model_state(model), dtype), model)
    if _is_transformers(model):
        from transformers.core_model_loading import revert_weight_conversion

        config = getattr(model, "config", None)
        with unsharded_classes(model), _as_loaded(model):
            try:
                hub = dict(revert_weight_conversion(model, meta))  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - an op with no meta form: say which model
                raise SaveError(
                    f"transformers' reverse weight conversion failed on meta tensors for "
                    f"{type(model).__name__} ({getattr(config, 'model_type', '?')}): {exc}"
                ) from exc
    else:
        hub = meta
    return hub


def header_bytes(entries: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, list[tuple[str, int]]]:
    """A safetensors header exactly as the ``safetensors`` library writes it.

    Args:
        entries: (name, safetensors dtype, shape) of every tensor of the file.

    Returns:
        (the header with its 8-byte length prefix, [(name, data offset relative to the
        end of the header)] in data order).

    Example:
        >>> header_bytes([("w", "F32", (2,))])[0]
        b'@\\x00\\x00\\x00\\x00\\x00\\x00\\x00{"__metadata__":{"format":"pt"},"w":{...}}   '
    """
    for name, dt, _ in entries:
        if dt not in _DTYPE_RANK:
            raise SaveError(f"dtype {dt} of '{name}' has no safetensors order", tensor=name)
    order = sorted(entries, key=lambda e: (-_DTYPE_RANK[e[1]], e[0]))
    body: dict[str, Any] = {"__metadata__": dict(HEADER_METADATA)}
    offsets: list[tuple[str, int]] = []
    pos = 0
    for name, dt, shape in order:
        n = ITEMSIZE[dt]
        for s in shape:
            n *= s
        body[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets.append((name, pos))
        pos += n
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def _num_parameters(model: nn.Module) -> int:
    if _is_transformers(model):
        return int(model.num_parameters())  # type: ignore[operator]
    return sum(p.numel() for p in model.parameters())


def output_layout(
    model: nn.Module, *, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB"
) -> Layout:
    """Plans the output checkpoint of ``model`` from its global shapes alone.

    Args:
        model: the model to save (FSDP2 / TP / EP sharded, or plain).
        dtype: optional cast of floating-point tensors (``torch.bfloat16``).
        max_shard_size: the largest file before splitting (``"5GB"`` or bytes), as in
            transformers' ``save_pretrained``.

    Returns:
        The Layout: every hub tensor's file and absolute offset, the file headers and the
        index, identical on every rank.

    Example:
        >>> lay = output_layout(model, max_shard_size="2GB")
        >>> [f.name for f in lay.files]
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    return layout_of(hub_state(model, dtype), model, max_shard_size)


def layout_of(
    hub: dict[str, torch.Tensor],
    model: nn.Module,
    max_shard_size: int | str,
    total_parameters: bool = True,
    file_of: Mapping[str, str] | None = None,
) -> Layout:
    """The files, headers and index of the hub tensors ``hub`` (meta tensors, views sharing
    the storage transformers' splitter groups by), split by ``max_shard_size``, or into the
    given ``files`` (hub key -> file name; an index always); the index's metadata names
    ``total_parameters`` as transformers' does (not accelerate's: False).

    Example:
        >>> layout_of(hub_state(model), model, "5GB").files[0].name
        'model.safetensors'
    """
    try:  # the [hf] extra (transformers brings it), not a core dependency
        from huggingface_hub.serialization._base import split_state_dict_into_shards_factory
    except ImportError as e:
        raise SaveError(
            f"saving needs huggingface_hub's shard splitter ({e})",
            hint="pip install 'streamload[hf]'",
        ) from e

    split = (
        _given_split(hub, file_of)
        if file_of is not None
        else split_state_dict_into_shards_factory(
            hub,
            get_storage_size=lambda t: t.untyped_storage().nbytes(),
            get_storage_id=lambda t: id(_root(t)),
            filename_pattern=FILE_PATTERN,
            max_shard_size=max_shard_size,
        )
    )
    placed: dict[str, tuple[str, int]] = {}
    files: list[OutputFile] = []
    for fname in sorted(split.filename_to_tensors):
        names = split.filename_to_tensors[fname]
        entries = [(k, ST_DTYPES[hub[k].dtype], tuple(hub[k].shape)) for k in names]
        header, offsets = header_bytes(entries)
        size = len(header)
        for k, off in offsets:
            placed[k] = (fname, len(header) + off)
        size += sum(ITEMSIZE[dt] * _numel(shape) for _, dt, shape in entries)
        files.append(OutputFile(fname, header, size, tuple(k for k, _ in offsets)))
    tensors = {
        k: HubTensor(k, ST_DTYPES[t.dtype], tuple(t.shape), placed[k][0], placed[k][1])
        for k, t in hub.items()
        if k in placed
    }
    index = None
    if split.is_sharded:
        doc = {
            "metadata": {"total_parameters": _num_parameters(model), **split.metadata}
            if total_parameters
            else dict(split.metadata),
            "weight_map": dict(split.tensor_to_filename),
        }
        index = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    return Layout(tensors, files, index, int(split.metadata["total_size"]))


def _given_split(hub: dict[str, torch.Tensor], files: Mapping[str, str]) -> Any:
    """huggingface_hub's split result for a given file of every hub key (always an index)."""
    from types import SimpleNamespace

    by_file: dict[str, list[str]] = {}
    for k in hub:
        by_file.setdefault(files[k], []).append(k)
    total = sum(_numel(tuple(t.shape)) * t.element_size() for t in hub.values())
    return SimpleNamespace(
        filename_to_tensors=by_file,
        tensor_to_filename={k: files[k] for k in hub},
        is_sharded=True,
        metadata={"total_size": total},
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def saved_config(model: nn.Module, config: Any, dtype: torch.dtype | None) -> Any:
    """The config transformers' ``save_pretrained`` writes: a copy with ``dtype`` and
    ``architectures`` set (the model's own config is left as it is).

    Args:
        model: the model.
        config: the config to save (default ``model.config``); None when there is none.
        dtype: the save's cast, if any.

    Returns:
        The config to save, or None.

    Example:
        >>> saved_config(model, None, torch.bfloat16).dtype
        'bfloat16'
    """
    cfg = config if config is not None else getattr(model, "config", None)
    if cfg is None:
        return None
    cfg = copy.deepcopy(cfg)
    if _is_transformers(model):
        saved = dtype if dtype is not None else model.dtype  # type: ignore[union-attr]
        cfg.dtype = str(saved).split(".")[1]
        cfg.architectures = [type(model).__name__.removeprefix("FSDP")]
    return cfg
