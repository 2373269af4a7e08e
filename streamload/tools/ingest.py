"""`streamload ingest SRC DST`: rewrite a checkpoint in the model's in-memory
(fused) layout, so later loads need no conversion.

Every output file's header is computed first; the data section is then
filled through a writable shared mapping of the output file, straight from
the mapped sources by the native copy engine. Nothing anonymous scales with
the checkpoint. Files go to a temporary sibling directory that is renamed to
DST only when everything is written and synced, by the directory commit a
save uses (``save.directory``): an interrupted run never leaves a checkpoint
that looks complete, and an existing DST, even one that appears while the
ingest runs, is never replaced.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, KeyMismatchError
from ..integrations.pretrained import meta_model
from ..io.checkpoint import INDEX_NAME, Checkpoint
from ..io.copy_ops import ITEMSIZE, ST_DTYPES, OpBatch, contiguous_strides
from ..model.state import ignore_patterns, record_state
from ..plan.buckets import ALIGN, Target, validate_shapes
from ..plan.convert import FallbackSources, plan_conversions
from ..plan.keys import match_keys
from ..plan.quant import QuantTensor, quantized_view, scheme_from_config
from ..save.directory import DirectoryCommit, new_token, resolve
from ..transport.pack import add_box_ops


@dataclass
class IngestReport:
    files: int
    tensors: int
    bytes_written: int
    converted: int
    dropped: list[str]


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper()
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def _out_dtype(src_dtype: str, want: torch.dtype | None) -> str:
    if want is None or src_dtype not in ("F16", "BF16", "F32", "F64"):
        return src_dtype
    return ST_DTYPES[want]


def _layout(
    targets: list[Target], dtypes: dict[str, str], max_shard: int
) -> list[list[tuple[Target, str, int, int]]]:
    """Groups targets into files: (target, dtype, begin, end) per tensor.

    Within a file tensors are ordered by element size, largest first, as
    safetensors does, so every tensor starts aligned to its element size.
    """

    def nbytes(t: Target) -> int:
        n = ITEMSIZE[dtypes[t.name]]
        for s in t.shape:
            n *= s
        return n

    groups: list[list[Target]] = [[]]
    size = 0
    for t in targets:
        if groups[-1] and size + nbytes(t) > max_shard:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes(t)
    files = []
    for group in groups:
        entries, offset = [], 0
        for t in sorted(group, key=lambda t: (-ITEMSIZE[dtypes[t.name]], t.name)):
            entries.append((t, dtypes[t.name], offset, offset + nbytes(t)))
            offset += nbytes(t)
        files.append(entries)
    return files


def _header(entries: list[tuple[Target, str, int, int]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for t, dtype, begin, end in entries:
        header[t.name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [begin, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def ingest(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    threads: int | None = None,
) -> IngestReport:
    """Rewrites ``src`` into ``dst`` in the model's own (fused) layout.

    Args:
        src: checkpoint directory (config.json + safetensors).
        dst: output directory; must not exist (resolved through symlinks; missing parents are
            made). Written into ``.<name>.streamload-tmp-<id>`` beside it, renamed at the end.
        dtype: cast floating tensors to this dtype (default: keep).
        max_shard_size: largest output file, e.g. "5GB".
        threads: native copy threads.

    Returns:
        An IngestReport.

    Raises:
        CheckpointError: ``dst`` exists, or appeared while the ingest ran (it is never replaced).

    Example:
        >>> streamload.tools.ingest.ingest("qwen3-moe-hub", "qwen3-moe-fused", dtype=torch.bfloat16)
    """
    src_p, dst_p = Path(src), resolve(dst)  # as a save resolves its target: through symlinks
    if os.path.lexists(dst_p):
        raise CheckpointError("destination exists; ingest never overwrites", str(dst_p))
    ckpt = Checkpoint(src_p, threads=threads)
    model = meta_model(src_p)
    state = record_state(model)
    # A quantized checkpoint is written dequantized (values x scales, in
    # ``dtype``, default float32); its scales are consumed.
    table, quant = quantized_view(
        {t.name: (t.dtype, t.shape, t.file) for t in ckpt.tensors}, scheme_from_config(model.config)
    )
    shapes = {n: tuple(t.shape) for n, t in state.targets().items()}
    conversion = plan_conversions(model, table, shapes)
    full_table = {**table, **conversion.virtual_table}
    match = match_keys(state, shapes, full_table, *ignore_patterns(model), conversion)
    if match.missing:
        raise KeyMismatchError(
            f"{len(match.missing)} missing keys {match.missing[:20]}", str(src_p), missing=match.missing
        )
    validate_shapes(match.targets, full_table)
    out_dtypes = {t.name: _out_dtype(full_table[t.pieces[0].key][0], dtype) for t in match.targets}
    layout = _layout(match.targets, out_dtypes, parse_size(max_shard_size))
    inputs = _Inputs(ckpt, FallbackSources(conversion, ckpt, model, quant), quant)

    out = DirectoryCommit(dst_p, new_token(), replace=False)
    try:
        out.prepare()
        tmp = out.tmp
        weight_map: dict[str, str] = {}
        written = 0
        for i, entries in enumerate(layout):
            name = f"model-{i + 1:05d}-of-{len(layout):05d}.safetensors"
            written += _write_file(tmp / name, entries, inputs)
            weight_map.update({t.name: name for t, *_ in entries})
        total = sum(end - begin for entries in layout for _, _, begin, end in entries)
        (tmp / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        for f in src_p.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != INDEX_NAME:
                shutil.copy2(f, tmp / f.name)
        if dtype is not None:
            _set_config_dtype(tmp / "config.json", dtype)
        if quant:
            _drop_quantization_config(tmp / "config.json")
        out.commit()  # fsynced, then renamed into place unless DST appeared meanwhile
    except FileExistsError as exc:
        out.discard()
        if exc.filename is not None and Path(exc.filename) != out.target and exc.filename2 is None:
            raise  # another file (a copy into the temporary directory), not the destination
        raise CheckpointError("destination exists; ingest never overwrites", str(dst_p)) from exc
    except BaseException:
        out.discard()
        raise
    return IngestReport(len(layout), len(match.targets), written, len(match.converted), match.unexpected)


@dataclass(frozen=True)
class _Inputs:
    """Where an output tensor's bytes come from: the files, the fallback conversions, the quantized views."""

    ckpt: Checkpoint
    fallbacks: FallbackSources
    quant: dict[str, QuantTensor]


def _write_file(path: Path, entries: list[tuple[Target, str, int, int]], inputs: _Inputs) -> int:
    head = _header(entries)
    data_len = entries[-1][3] if entries else 0
    with open(path, "w+b") as f:
        f.write(head)
        f.truncate(len(head) + data_len)
        if data_len:
            with mmap.mmap(f.fileno(), len(head) + data_len, access=mmap.ACCESS_WRITE) as mm:
                out = torch.frombuffer(mm, dtype=torch.uint8)
                try:
                    _fill(out, len(head), entries, inputs)
                    mm.flush()
                finally:
                    del out
        f.flush()
        os.fsync(f.fileno())
    return data_len


def _fill(
    out: torch.Tensor, data_start: int, entries: list[tuple[Target, str, int, int]], inputs: _Inputs
) -> None:
    """One target at a time: its source regions straight into the mapped file."""
    for t, dtype, begin, _end in entries:
        batch = OpBatch()
        keep: list[torch.Tensor] = []
        box = tuple((0, s) for s in t.shape)
        dst_strides = contiguous_strides(t.shape)
        first, misaligned = divmod(data_start + begin, ITEMSIZE[dtype])
        if misaligned:
            raise CheckpointError("misaligned output tensor", tensor=t.name)
        ckpt = inputs.ckpt
        add_box_ops(
            batch,
            ckpt,
            t.pieces,
            box,
            out,
            dtype,
            dst_strides,
            first,
            None,
            inputs.fallbacks,
            keep,
            inputs.quant,
        )
        batch.execute(ckpt.engine, ckpt.files)
        keep.clear()


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    if not path.exists():
        return
    cfg = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = name
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _drop_quantization_config(path: Path) -> None:
    if path.exists():
        cfg = json.loads(path.read_text())
        cfg.pop("quantization_config", None)
        path.write_text(json.dumps(cfg, indent=2) + "\n")
