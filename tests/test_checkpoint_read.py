"""Every tensor streamload reads equals safetensors' own reader, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import streamload
from streamload.io.copy_ops import TORCH_DTYPES, bit_view


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 3), (4, 3, 2, 5)]


@pytest.fixture(scope="module")
def all_dtypes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, dt in TORCH_DTYPES.items():
        for i, shape in enumerate(SHAPES):
            tensors[f"{name.lower()}.{i}"] = _random(dt, shape, gen)
    return tensors


def _write_sharded(root: Path, tensors: dict[str, torch.Tensor], nshards: int) -> None:
    names = sorted(tensors)
    weight_map = {}
    for s in range(nshards):
        fname = f"model-{s + 1:05d}-of-{nshards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::nshards]}
        save_file(part, str(root / fname), metadata={"format": "pt", "shard": str(s)})
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _reference(path: Path) -> dict[str, torch.Tensor]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


@pytest.mark.parametrize("layout", ["single", "sharded", "sharded_no_index"])
@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_reads_equal_safetensors(tmp_path: Path, all_dtypes, layout: str, mode: str) -> None:
    if layout == "single":
        path = tmp_path / "model.safetensors"
        save_file(all_dtypes, str(path), metadata={"format": "pt"})
    else:
        path = tmp_path
        _write_sharded(tmp_path, all_dtypes, 3)
        if layout == "sharded_no_index":
            (tmp_path / "model.safetensors.index.json").unlink()
    ckpt = streamload.Checkpoint(path, mode=mode)
    assert all(f.mapped == (mode == "mmap") for f in ckpt.files)
    ref = _reference(path)
    assert sorted(ckpt.keys()) == sorted(ref)
    for name, want in ref.items():
        got = ckpt.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(bit_view(got), bit_view(want)), name
        out = torch.empty_like(want)
        assert ckpt.read(name, out=out) is out
        assert torch.equal(bit_view(out), bit_view(want)), name
    info = ckpt.info("f32.3")
    assert info.shape == (3, 5) and info.dtype == "F32" and info.nbytes == 60
    if layout != "sharded_no_index":
        assert any(m.get("format") == "pt" for m in ckpt.metadata.values())


@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_read_region_and_cast(tmp_path: Path, mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(37, 19, 5, generator=gen).to(torch.bfloat16)
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    ckpt = streamload.Checkpoint(tmp_path / "m.safetensors", mode=mode)
    for box in [
        (slice(3, 20), slice(0, 19), slice(1, 4)),
        ((0, 37), (5, 6), (0, 5)),
        ((36, 37), (0, 0), (0, 5)),
    ]:
        sl = tuple(b if isinstance(b, slice) else slice(*b) for b in box)
        got = ckpt.read_region("w", box)
        assert torch.equal(got, w[sl])
        got32 = ckpt.read_region("w", box, dtype=torch.float32)
        assert torch.equal(bit_view(got32), bit_view(w[sl].to(torch.float32)))
    f16 = ckpt.read("w", dtype=torch.float16)
    assert torch.equal(bit_view(f16), bit_view(w.to(torch.float16)))
    many = {"w": (torch.empty(2, 19, 5, dtype=torch.float32), [10, 0, 0])}
    assert ckpt.read_into(many) == 2 * 19 * 5 * 2
    assert torch.equal(bit_view(many["w"][0]), bit_view(w[10:12].float()))
    with pytest.raises(streamload.DTypeMismatchError):
        ckpt.read("w", dtype=torch.int32)
    with pytest.raises(streamload.CheckpointError):
        ckpt.read_region("w", ((0, 38), (0, 19), (0, 5)))
    with pytest.raises(streamload.TensorNotFoundError):
        ckpt.read("missing")
