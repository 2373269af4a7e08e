"""Bad checkpoints raise named errors that carry the file and tensor."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import streamload
from streamload.io import _native


def _file(tmp: Path, header: dict, data: bytes, name: str = "m.safetensors", pad: bool = True) -> Path:
    raw = json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    path = tmp / name
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _good(tmp: Path) -> Path:
    save_file(
        {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 2, dtype=torch.bfloat16)},
        str(tmp / "m.safetensors"),
    )
    return tmp / "m.safetensors"


CASES = {
    "unknown_dtype": (
        {"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}},
        b"\0" * 8,
        "w",
        "unknown dtype",
    ),
    "wrong_byte_count": (
        {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
        b"\0" * 8,
        "w",
        "12 bytes",
    ),
    "offsets_past_data": (
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        b"\0" * 8,
        "w",
        "past the data",
    ),
    "overlap": (
        {
            "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        b"\0" * 12,
        "v",
        "overlap",
    ),
    "begin_after_end": (
        {"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}},
        b"\0" * 8,
        "w",
        "begin > end",
    ),
    "negative_shape": (
        {"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}},
        b"\0",
        "w",
        "bad shape",
    ),
    "shape_overflow": (
        {"w": {"dtype": "F64", "shape": [2**40, 2**40], "data_offsets": [0, 8]}},
        b"\0" * 8,
        "w",
        "overflow",
    ),
    "missing_field": ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "w", "data_offsets"),
    "bad_metadata": ({"__metadata__": {"k": 1}}, b"", None, "not a string"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_header_violations(tmp_path: Path, case: str) -> None:
    header, data, tensor, match = CASES[case]
    path = _file(tmp_path, header, data)
    for mode in ("mmap", "pread"):
        with pytest.raises(streamload.HeaderError, match=match) as err:
            streamload.Checkpoint(path, mode=mode)
        assert err.value.file == str(path)
        assert err.value.tensor == tensor
        assert str(path) in str(err.value)


def test_invalid_json_and_lengths(tmp_path: Path) -> None:
    raw = b'{"w": {"dtype": "F32", '
    p = tmp_path / "json.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(streamload.HeaderError, match="invalid header JSON") as err:
        streamload.Checkpoint(p)
    assert err.value.file == str(p)
    p.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(streamload.HeaderError, match="past the end of the file"):
        streamload.Checkpoint(p)
    p.write_bytes(b"\x01\x02")
    with pytest.raises(streamload.HeaderError, match="shorter than"):
        streamload.Checkpoint(p)
    p.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(streamload.HeaderError, match="100 MB"):
        streamload.Checkpoint(p)
    raw = b'{"a": {"dtype":"U8","shape":[0],"data_offsets":[0,0]}, "a": {}}'
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(streamload.HeaderError, match="duplicate key"):
        streamload.Checkpoint(p)


def test_truncated_file(tmp_path: Path) -> None:
    good = _good(tmp_path)
    data = good.read_bytes()
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(data[:-5])
    with pytest.raises(streamload.HeaderError, match="past the data section") as err:
        streamload.Checkpoint(trunc)
    assert err.value.tensor in {"a", "b"}


def test_file_truncated_while_open(tmp_path: Path) -> None:
    good = _good(tmp_path)
    ckpt = streamload.Checkpoint(good, mode="pread")
    os.truncate(good, 20)
    with pytest.raises(streamload.CheckpointFileError, match="shrank"):
        ckpt.check_unchanged()
    with pytest.raises(streamload.CheckpointFileError):
        ckpt.read("b")


# A file symlink ("link.safetensors") is followed, as the hub cache needs: tests/test_checkpoint_sources.py.
@pytest.mark.parametrize(
    "entry", ["../x.safetensors", "/etc/x.safetensors", "sub/../../x.safetensors", "out/x.safetensors"]
)
def test_index_paths_cannot_escape(tmp_path: Path, entry: str) -> None:
    outside = tmp_path / "x.safetensors"
    _good(tmp_path).rename(outside)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "link.safetensors").symlink_to(outside)
    (ckpt / "out").symlink_to(tmp_path, target_is_directory=True)  # a directory link leading out
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": entry, "b": entry}}))
    with pytest.raises(streamload.UnsafePathError) as err:
        streamload.Checkpoint(ckpt)
    assert entry in str(err.value) or "outside" in str(err.value)


def test_index_inconsistencies(tmp_path: Path) -> None:
    _good(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"zzz": "m.safetensors"}})
    )
    with pytest.raises(streamload.CheckpointIndexError) as err:
        streamload.Checkpoint(tmp_path)
    assert err.value.tensor == "zzz"
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(streamload.CheckpointIndexError):
        streamload.Checkpoint(tmp_path)


# -- fuzzing: mutated real headers never crash the process -----------------------


def _real_header() -> bytes:
    import safetensors.torch

    return safetensors.torch.save(
        {
            "model.layers.0.w": torch.ones(3, 4, dtype=torch.bfloat16),
            "model.norm.weight": torch.ones(4),
            "e": torch.zeros(0, 2),
        },
        metadata={"format": "pt"},
    )


REAL = _real_header()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, len(REAL) - 1), st.integers(0, 255)), max_size=8),
    st.integers(0, len(REAL)),
)
def test_fuzz_mutated_headers(mutations: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(REAL)
    for pos, val in mutations:
        data[pos] = val
    data = bytes(data[: max(cut, 0)]) if cut < len(REAL) // 2 else bytes(data)
    try:
        table, _meta, start = _native.parse_header(data)
    except streamload.HeaderError as exc:
        assert exc.file == "<memory>"
        return
    for _name, dtype, _shape, begin, end in table:
        assert begin <= end <= len(data) - start
        assert dtype in _native.DTYPE_CODES


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(blob: bytes) -> None:
    data = struct.pack("<Q", len(blob)) + blob
    try:
        _native.parse_header(data)
    except streamload.HeaderError:
        pass


def test_mapped_file_truncated_while_open_is_an_error_not_a_crash(tmp_path: Path) -> None:
    import faulthandler

    faulthandler.enable()  # as under pytest: our SIGBUS guard must still win
    path = tmp_path / "big.safetensors"
    save_file({"w": torch.randn(1024, 1024)}, str(path))
    ckpt = streamload.Checkpoint(path, mode="mmap")
    os.truncate(path, 4096)
    for _ in range(2):  # and again: the guard stays installed
        with pytest.raises(streamload.CheckpointFileError, match="truncated"):
            ckpt.read("w")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, len(REAL) - 1), st.integers(0, 255)), min_size=1, max_size=6),
    st.sampled_from(["mmap", "pread"]),
)
def test_fuzz_checkpoint_over_mutated_files(mutations: list[tuple[int, int]], mode: str) -> None:
    """Checkpoint (open, table, every read) on mutated real files: a named
    error or a correct read, never a crash or a read outside the file."""
    import tempfile

    data = bytearray(REAL)
    for pos, val in mutations:
        data[pos] = val
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.safetensors"
        path.write_bytes(bytes(data))
        try:
            ckpt = streamload.Checkpoint(path, mode=mode)
        except streamload.StreamloadError as exc:
            assert exc.file is not None
            return
        for info in ckpt.tensors:
            assert info.offset + info.nbytes <= len(data)
            try:
                t = ckpt.read(info.name)
            except streamload.StreamloadError:
                continue
            assert tuple(t.shape) == info.shape
