"""Conversions: model tensors the checkpoint stores differently.

transformers' own conversion mapping (``conversion_mapping`` and
``core_model_loading``) is the source of truth: its renamings rename keys,
and its converters' operations are turned into region algebra
(MergeModulelist -> stack, Concatenate -> cat, Transpose, Chunk), so every
rank's shard is copied straight from the per-expert tensors. An operation
with no region form falls back to transformers' own op, applied on the
reader to one source group at a time (bounded memory, one warning).
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..io.copy_ops import TORCH_DTYPES
from ..io.dequant import read_dequantized
from ..model.hf import unsharded_classes
from .regions import SourcePiece, identity_piece, regions_for_box

# The checkpoint's tensor table as every rank receives it: key -> (dtype, shape, file).
Table = dict[str, tuple[str, tuple[int, ...], str]]
FALLBACK_PREFIX = "streamload:fallback:"


@dataclass
class Sym:
    """A symbolic tensor: a shape tiled by source pieces."""

    shape: tuple[int, ...]
    pieces: list[SourcePiece]


def stack(values: Sequence[Sym], dim: int) -> Sym:
    """``torch.stack`` of symbolic tensors.

    Args:
        values: same-shaped tensors.
        dim: the new dim.

    Returns:
        The stacked tensor's pieces.

    Raises:
        ValueError: the shapes differ.

    Example:
        >>> stack([Sym((2, 3), [...]), Sym((2, 3), [...])], 0).shape
        (2, 2, 3)
    """
    first = values[0].shape
    if any(v.shape != first for v in values):
        raise ValueError("cannot stack tensors of different shapes")
    out: list[SourcePiece] = []
    for i, v in enumerate(values):
        for p in v.pieces:
            out.append(
                SourcePiece(
                    p.key,
                    (*p.dst_start[:dim], i, *p.dst_start[dim:]),
                    (*p.shape[:dim], 1, *p.shape[dim:]),
                    p.src_start,
                    (*p.dims[:dim], None, *p.dims[dim:]),
                )
            )
    return Sym((*first[:dim], len(values), *first[dim:]), out)


def cat(values: Sequence[Sym], dim: int) -> Sym:
    """``torch.cat`` of symbolic tensors.

    Args:
        values: tensors equal in every dim but ``dim``.
        dim: the dim to concatenate along.

    Returns:
        The concatenated tensor's pieces.

    Raises:
        ValueError: the other dims differ.

    Example:
        >>> cat([Sym((2, 3), [...]), Sym((1, 3), [...])], 0).shape
        (3, 3)
    """
    shape = list(values[0].shape)
    offset = 0
    out: list[SourcePiece] = []
    for v in values:
        if len(v.shape) != len(shape) or any(
            a != b for d, (a, b) in enumerate(zip(v.shape, shape, strict=True)) if d != dim
        ):
            raise ValueError("cannot concatenate tensors of different shapes")
        for p in v.pieces:
            start = list(p.dst_start)
            start[dim] += offset
            out.append(SourcePiece(p.key, tuple(start), p.shape, p.src_start, p.dims))
        offset += v.shape[dim]
    shape[dim] = offset
    return Sym(tuple(shape), out)


def _transpose(v: Sym, d0: int, d1: int) -> Sym:
    def sw(t: tuple) -> tuple:
        lst = list(t)
        lst[d0], lst[d1] = lst[d1], lst[d0]
        return tuple(lst)

    return Sym(
        sw(v.shape),
        [SourcePiece(p.key, sw(p.dst_start), sw(p.shape), p.src_start, sw(p.dims)) for p in v.pieces],
    )


def narrow(v: Sym, dim: int, start: int, size: int) -> Sym:
    """``torch.narrow`` of a symbolic tensor: the pieces that fill the slice.

    Args:
        v: the tensor.
        dim: the dim to slice.
        start: first index.
        size: how many.

    Returns:
        The slice's pieces, placed relative to it.

    Example:
        >>> narrow(Sym((8, 3), [...]), 0, 2, 4).shape
        (4, 3)
    """
    box = tuple((start, start + size) if d == dim else (0, s) for d, s in enumerate(v.shape))
    # The regions that fill the box, placed relative to it, are the narrowed pieces.
    pieces = [
        SourcePiece(r.key, r.box_start, r.shape, r.src_start, r.dims) for r in regions_for_box(v.pieces, box)
    ]
    shape = list(v.shape)
    shape[dim] = size
    return Sym(tuple(shape), pieces)


# The old private names, still imported by tests/test_plan.py.
_stack, _cat, _narrow = stack, cat, narrow


def _chunk(v: Sym, dim: int, n: int) -> list[Sym]:
    """torch.chunk semantics: chunks of ceil(size / n)."""
    size = v.shape[dim]
    step = -(-size // n)
    return [narrow(v, dim, s, min(step, size - s)) for s in range(0, size, step)]


class NotStreamable(Exception):
    """An operation with no region form: use transformers' own op."""


def _as_list(x: Sym | list[Sym]) -> list[Sym]:
    return x if isinstance(x, list) else [x]


def apply_ops_symbolically(
    converter: Any,
    inputs: dict[str, list[Sym]],
    expected: dict[str, tuple[int, ...]],
    config: Any = None,
    layer_name: str | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, Sym]:
    """Runs a WeightConverter's operations on symbolic tensors.

    Mirrors each op's ``convert`` (same key naming rules), so the result is
    keyed like transformers' own output. Raises NotStreamable for ops that
    are not plain region maps. ``layer_name`` and ``shapes`` (model target ->
    shape) size a Split's pieces as transformers does, by its targets' shapes.
    """
    from transformers import core_model_loading as cml

    sources, targets = list(converter.source_patterns), list(converter.target_patterns)
    data: dict[str, Any] = dict(inputs)
    for op in converter.operations:
        name = type(op).__name__
        if isinstance(op, cml.MergeModulelist):
            n = len(data)
            merged: dict[str, Any] = {}
            for key, vals in data.items():
                out_key = (targets[0] if len(targets) == 1 else _undefined()) if n == 1 else key
                merged[out_key] = stack(_as_list(vals), op.dim)
            data = merged
        elif isinstance(op, cml.Concatenate) and type(op) is cml.Concatenate:
            parts: list[Sym] = []
            for sp in sources:
                if sp in data:
                    parts.extend(_as_list(data.pop(sp)))
            if len(targets) > 1:
                _undefined()
            data = {targets[0]: cat(parts, op.dim)}
        elif isinstance(op, cml.Transpose) and type(op) is cml.Transpose:
            if len(data) != 1:
                _undefined()
            val = _as_list(next(iter(data.values())))[0]
            key = targets[0] if len(targets) == 1 else sources[0]
            if op.check_dims and val.shape == expected.get(key, expected.get("*", ())):
                data = {key: val}
            else:
                data = {key: _transpose(val, op.dim0, op.dim1)}
        elif isinstance(op, cml.Chunk) and type(op) is cml.Chunk:
            if len(data) != 1:
                _undefined()
            val = _as_list(next(iter(data.values())))[0]
            outs = op.get_target_patterns(targets, config=config)
            chunks = _chunk(val, op.dim, len(outs))
            data = dict(zip(outs, chunks, strict=True))
        elif isinstance(op, cml.Split) and type(op) is cml.Split:
            if len(data) != 1 or layer_name is None or shapes is None:
                raise NotStreamable("undefined operation layout")
            val = _as_list(next(iter(data.values())))[0]
            names = [layer_name.replace(targets[0], t) for t in targets]
            if any(n not in shapes for n in names):
                raise NotStreamable("Split targets not in the model")
            sizes = [shapes[n][op.dim] for n in names]
            if sum(sizes) != val.shape[op.dim]:
                # torch.split would raise: let transformers' own op say so.
                raise NotStreamable("Split sizes do not add up")
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            data = {t: narrow(val, op.dim, a, n) for t, a, n in zip(targets, starts, sizes, strict=True)}
        else:
            raise NotStreamable(name)
    return {k: (_as_list(v)[0]) for k, v in data.items()}


def _undefined() -> Any:
    raise NotStreamable("undefined operation layout")


def natural_key(s: str) -> list:
    from transformers.core_model_loading import dot_natural_key

    return dot_natural_key(s)


@dataclass
class Fallback:
    """A target built by transformers' own op on the reader (one group at a time)."""

    converter: Any
    inputs: dict[str, list[str]]  # source pattern -> checkpoint keys, in order
    layer_name: str
    output: str  # target name


@dataclass
class Conversion:
    """How checkpoint keys become model targets.

    Attributes:
        pieces: target name -> pieces, for renamed or converted targets.
        described: target name -> what built it.
        fallbacks: virtual key -> the group the reader materialises.
        virtual_table: virtual key -> (dtype, shape, file) for planning.
        consumed: checkpoint keys used by conversions.
        sources: target name -> the checkpoint keys it is built from.
    """

    pieces: dict[str, tuple[SourcePiece, ...]] = field(default_factory=dict)
    described: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, Fallback] = field(default_factory=dict)
    virtual_table: Table = field(default_factory=dict)
    consumed: set[str] = field(default_factory=set)
    sources: dict[str, set[str]] = field(default_factory=dict)


def _weight_mapping(model: nn.Module) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    # Looked up on the classes transformers registered, not fully_shard's subclasses.
    with unsharded_classes(model):
        return get_model_conversion_mapping(model)


def _full_names(layer_name: str, keys: Sequence[str]) -> dict[str, str]:
    """transformers' expansion of op output keys to full names (``WeightConverter.convert``):
    the prefix and suffix around the first key found in the layer name, applied to every key."""
    full = layer_name.replace("*.", "0.") if "*." in layer_name else layer_name
    hit = next((k for k in keys if k in full), None)
    if hit is None:
        return {k: k for k in keys}
    prefix, _, suffix = full.partition(hit)
    return {k: prefix + k + suffix for k in keys}


def plan_conversions(model: nn.Module, table: Table, targets: dict[str, tuple[int, ...]]) -> Conversion:
    """Maps checkpoint keys to model targets with transformers' mapping.

    Args:
        model: the model (its class and config choose the mapping).
        table: the checkpoint's tensor table.
        targets: model target name -> global shape.

    Returns:
        The Conversion; targets present in the checkpoint as they are get no entry.
    """
    conv = Conversion()
    if "transformers.modeling_utils" not in sys.modules:
        return conv  # not a transformers model (it would have imported it): no mapping, no import
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    if all(k in table and tuple(table[k][1]) == tuple(shape) for k, shape in targets.items()):
        # Every target is in the checkpoint as it is: nothing to convert, and
        # transformers' mapping tables (a few hundred regexes) need not be built.
        return conv
    mapping = _weight_mapping(model)
    if not mapping:
        return conv
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    meta_state = dict.fromkeys(targets, True)
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(table, key=natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in targets and key in targets:
            continue  # present as it is
        if renamed not in targets:
            continue
        if pattern is None:
            if renamed != key and renamed not in table:
                conv.pieces[renamed] = (identity_piece(key, table[key][1]),)
                conv.described[renamed] = f"renamed from {key}"
                conv.consumed.add(key)
                conv.sources[renamed] = {key}
            continue
        conv_obj, inputs = groups.setdefault(renamed, (by_pattern[pattern], {}))
        inputs.setdefault(pattern, []).append(key)
    config = getattr(model, "config", None)
    for layer_name, (converter, inputs) in groups.items():
        leaves = {
            p: [Sym(table[k][1], [identity_piece(k, table[k][1])]) for k in keys]
            for p, keys in inputs.items()
        }
        ops = "+".join(type(op).__name__ for op in converter.operations)
        try:
            outs = apply_ops_symbolically(
                converter, leaves, {"*": targets[layer_name]}, config, layer_name, targets
            )
            full = _full_names(layer_name, list(outs))
            for out_key, sym in outs.items():
                name = full[out_key] if len(outs) > 1 else layer_name
                if name in targets:
                    conv.pieces[name] = tuple(sym.pieces)
                    conv.described[name] = f"streamed {ops} of {sum(len(v) for v in inputs.values())} tensors"
        except NotStreamable as exc:
            warnings.warn(
                f"streamload: {type(converter).__name__} op {exc} has no streaming form; "
                f"'{layer_name}' is materialised on the reader one group at a time",
                stacklevel=3,
            )
            _add_fallback(conv, model, converter, inputs, layer_name, targets, table)
        group_keys = {k for keys in inputs.values() for k in keys}
        conv.consumed.update(group_keys)
        for name in conv.described:
            if name not in conv.sources:
                conv.sources[name] = group_keys
    return conv


def _add_fallback(
    conv: Conversion,
    model: nn.Module,
    converter: Any,
    inputs: dict[str, list[str]],
    layer_name: str,
    targets: dict[str, tuple[int, ...]],
    table: Table,
) -> None:
    dtypes = {table[k][0] for keys in inputs.values() for k in keys}
    dtype = dtypes.pop() if len(dtypes) == 1 else "F32"
    # The output names and shapes come from running the op on meta tensors.
    try:
        metas = {
            p: [torch.empty(table[k][1], dtype=TORCH_DTYPES[table[k][0]], device="meta") for k in keys]
            for p, keys in inputs.items()
        }
        outs = run_converter(converter, metas, layer_name, model)
        shapes = {name: tuple(t.shape) for name, t in outs.items()}
    except Exception:  # noqa: BLE001 - an op that cannot run on meta: trust the model's shape
        shapes = {layer_name: targets[layer_name]}
    for name, shape in shapes.items():
        if name not in targets:
            continue
        vkey = FALLBACK_PREFIX + name
        conv.fallbacks[vkey] = Fallback(copy.deepcopy(converter), inputs, layer_name, name)
        conv.virtual_table[vkey] = (dtype, shape, "<reader: transformers op>")
        conv.pieces[name] = (identity_piece(vkey, shape),)
        conv.described[name] = "fallback: " + "+".join(type(op).__name__ for op in converter.operations)


def run_converter(
    converter: Any, inputs: dict[str, list[torch.Tensor]], layer_name: str, model: nn.Module
) -> dict[str, torch.Tensor]:
    """Applies transformers' own ops to one group, as its loader does; returns full names."""
    data: dict[str, Any] = {p: list(ts) for p, ts in inputs.items()}
    for op in converter.operations:
        data = op.convert(
            data,
            source_patterns=converter.source_patterns,
            target_patterns=converter.target_patterns,
            full_layer_name=layer_name,
            model=model,
            config=getattr(model, "config", None),
        )
    out = {}
    full = _full_names(layer_name, list(data))
    for key, value in data.items():
        value = value[0] if isinstance(value, list) else value
        out[full[key] if len(data) > 1 else layer_name] = value
    return out


class FallbackSources:
    """Materialises fallback groups on the reader, keeping one group at a time.

    Args:
        conversion: the planned conversions (their fallbacks).
        ckpt: the opened checkpoint.
        model: the model transformers' ops are applied for.
        quant: logical keys the checkpoint stores quantized: the fallback was
            planned on their dequantized (logical) form, so they are read
            dequantized (values times scales), never as the raw stored bytes.
    """

    def __init__(
        self, conversion: Conversion, ckpt: Any, model: nn.Module, quant: Mapping[str, Any] | None = None
    ) -> None:
        self.conversion = conversion
        self.ckpt = ckpt
        self.model = model
        self.quant = quant or {}
        self._key: str | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.conversion.fallbacks

    def tensor(self, vkey: str) -> torch.Tensor:
        fb = self.conversion.fallbacks[vkey]
        if self._key != fb.layer_name:
            self._tensors = {}  # release the previous group first: one group at a time
            inputs = {p: [self._read(k) for k in keys] for p, keys in fb.inputs.items()}
            self._tensors = run_converter(fb.converter, inputs, fb.layer_name, self.model)
            self._key = fb.layer_name
        dtype = TORCH_DTYPES[self.conversion.virtual_table[vkey][0]]
        return self._tensors[fb.output].to(dtype).contiguous()

    def _read(self, key: str) -> torch.Tensor:
        if key in self.quant:
            return read_dequantized(self.ckpt, self.quant[key])
        return self.ckpt.read(key)
