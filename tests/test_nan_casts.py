"""NaN payloads (issue #43 item 7): every cast a load makes gives torch's CPU bits, the ones
transformers' from_pretrained gives on the CPU. The construction: the native engine casts on the
host with torch's CPU NaN conventions, the wire carries the parameter's dtype, and the one cast a
receiver makes (bf16 -> f32) is a shift of the bits, with integer ops off the CPU. The CUDA half
(sm_80+ conversions write 0x7FFF) is in tests/test_gpu.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import cases_nan_casts as cases
import pytest
import torch
from rank_group import RankGroup
from safetensors.torch import load_file, save_file
from test_copy_ops import _run

from streamload.io.copy_ops import ST_DTYPES, bit_view
from streamload.plan.buckets import RECEIVER_CASTS, wire_dtype
from streamload.tools.synthetic import make_checkpoint
from streamload.transport.unpack import cast_into, widen_bf16_bits

WORLD = 3
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SOURCES = [*FLOATS, torch.float8_e4m3fn, torch.float8_e5m2]
# torch's own CPU cast gives a NaN different bits by its position in the tensor (vector body or
# scalar tail): no one reference to match, the engine keeps c10's scalar formula there.
POSITIONAL = {(torch.float16, torch.float32), (torch.float64, torch.bfloat16)}


def _nans(dtype: torch.dtype) -> torch.Tensor:
    """Every NaN of a 1- or 2-byte dtype; for f32/f64, 3000 random payloads of both signs."""
    if dtype.itemsize <= 2:
        n = 1 << (8 * dtype.itemsize)
        every = torch.arange(n, dtype=torch.int32).to(torch.uint8 if n == 256 else torch.int16).view(dtype)
        return every[torch.isnan(every.float())]
    g = torch.Generator().manual_seed(0)
    mant = 23 if dtype == torch.float32 else 52
    payload = torch.randint(1, 1 << mant, (3000,), generator=g)
    sign = torch.randint(0, 2, (3000,), generator=g)
    if dtype == torch.float32:
        bits = (sign << 31) | 0x7F800000 | payload
        return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)
    return ((sign << 63) | 0x7FF0000000000000 | payload).view(torch.float64)


@pytest.mark.parametrize(
    "src,dst",
    [
        pytest.param(s, d, id=f"{s}->{d}".replace("torch.", ""))
        for s, d in itertools.product(SOURCES, FLOATS)
        if s != d and (s, d) not in POSITIONAL
    ],
)
def test_the_engine_casts_nans_as_torch_does_on_the_cpu(src: torch.dtype, dst: torch.dtype) -> None:
    x = _nans(src).repeat(3)
    out = torch.empty(x.shape, dtype=dst)
    _run(x, out, shape=[x.numel()], src_strides=[1], dst_strides=[1])
    assert torch.equal(bit_view(out), bit_view(x.to(dst))), (src, dst)


@pytest.mark.parametrize(
    "src,dst",
    [pytest.param(s, d, id=f"{s}->{d}".replace("torch.", "")) for s, d in itertools.product(SOURCES, FLOATS)],
)
def test_receivers_are_asked_for_the_bf16_to_f32_shift_only(src: torch.dtype, dst: torch.dtype) -> None:
    s, d = ST_DTYPES[src], ST_DTYPES[dst]
    assert wire_dtype([s], d) == (s if (s, d) in RECEIVER_CASTS else d)
    assert wire_dtype([s, "F16" if s != "F16" else "F32"], d) == d  # mixed sources: the sender casts
    assert RECEIVER_CASTS == {("BF16", "F32")}  # a shift of the bits: nothing for a device to decide


def test_the_device_widening_is_torchs_cpu_cast_bit_for_bit() -> None:
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    dest = torch.full((256, 512), 7.0)[:, ::2]  # strided, as a shard's rows are
    widen_bf16_bits(dest, every)
    assert torch.equal(bit_view(dest), bit_view(every.to(torch.float32)))
    assert torch.equal(torch.full((256, 512), 7.0)[:, 1::2], dest.new_full((256, 256), 7.0))
    same = torch.empty(256, 256)
    cast_into(same, every)  # the CPU receiver: torch's copy_, the same bits
    assert torch.equal(bit_view(same), bit_view(dest))
    with pytest.raises(AssertionError, match="bf16 -> f32 only"):
        cast_into(torch.empty(3, dtype=torch.bfloat16), torch.ones(3))


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


def _with_nans(src: Path, out: Path, dtype: torch.dtype) -> str:
    """``src`` as a ``dtype`` checkpoint whose 2-d tensors hold NaNs of many payloads."""
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(src / "model.safetensors"))
    sd = {k: (cases.put_nans(v.to(dtype)) if v.dim() == 2 else v.to(dtype)) for k, v in sd.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("nan_casts")
    base = make_checkpoint(
        root / "base",
        "qwen2",
        dtype=torch.float32,
        seed=9,
        layers=1,
        vocab=40,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    kinds = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f8": torch.float8_e4m3fn}
    return {name: _with_nans(base, root / name, dt) for name, dt in kinds.items()}


@pytest.mark.parametrize(
    "ckpt,dtype,readers,ws",
    [
        ("f32", "bfloat16", "owners", 2),
        ("f32", "bfloat16", "src", 3),
        ("f16", "bfloat16", "owners", 3),
        ("bf16", "float32", "owners", 3),
        ("bf16", "float32", "src", 2),
        ("bf16", "float16", "src", 3),
        ("f8", "bfloat16", "owners", 2),
    ],
)
def test_nan_payloads_load_as_transformers_loads_them(
    group: RankGroup, ckpts: dict[str, str], ckpt: str, dtype: str, readers: str, ws: int
) -> None:
    res = group.run(cases.case_nan_load, ckpt=ckpts[ckpt], ws=ws, readers=readers, dtype=dtype)
    assert sum(r["staged"] for r in res[:ws]) >= 1, res  # through the staged (device) pipeline
    for r in res[:ws]:
        assert r["nans"] > 50 and r["bad"] == [], r
