"""Dequantizing copy ops against transformers' own dequantization, bit for bit:
FP8 block-scaled (Fp8Dequantize, the `dequantize=True` load path) and MXFP4
(convert_moe_packed_tensors), on whole tensors, sub-boxes, strided and fused
destinations, from memory and from files in both read modes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

try:
    from streamload.io import _native as native
except ImportError:
    from streamload import _native as native
from streamload.errors import CopyOpError

ext = native._ext
CODES: dict[str, int] = dict(ext.DTYPE_CODES)
KINDS: dict[str, int] = dict(ext.DEQUANT_KINDS)
OUT = [
    (torch.bfloat16, "BF16", torch.int16),
    (torch.float32, "F32", torch.int32),
    (torch.float16, "F16", torch.int16),
]
ENGINE = native.CopyEngine(2)


def _op(
    kind: str, w: tuple[int, int, int, str], s: tuple[int, int, int, str], dst: torch.Tensor, dims: tuple[int, int, int],
    block: tuple[int, int], box: tuple[int, int, int, int, int, int] | None = None, dst_offset: int = 0,
    dst_strides: tuple[int, int, int] | None = None,
) -> list[int]:  # fmt: skip
    """One op row: w/s are (file, src, nbytes, dtype) with file -1 for an address."""
    batch, rows, cols = dims
    box = box or (0, batch, 0, rows, 0, cols)
    strides = dst_strides or (box[3] * box[5], box[5], 1)
    dname = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.float64: "F64"}[
        dst.dtype
    ]
    return [
        KINDS[kind], w[0], w[1], w[2], CODES[w[3]], s[0], s[1], s[2], CODES[s[3]],
        dst.data_ptr(), dst.numel() * dst.element_size(), CODES[dname], batch, rows, cols, *block, *box,
        dst_offset, *strides,
    ]  # fmt: skip


def _run(rows: list[list[int]], files: list[object] | None = None, engine: object = ENGINE) -> int:
    arr = np.ascontiguousarray(np.array(rows, dtype=np.int64))
    assert arr.shape[1] == ext.DEQUANT_FIELDS
    return ext.dequantize(engine, files or [], arr.ctypes.data, arr.nbytes)


def _mem(t: torch.Tensor, dtype: str) -> tuple[int, int, int, str]:
    return (-1, t.data_ptr(), t.numel() * t.element_size(), dtype)


def _fp8_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random e4m3 bytes plus the hard cases: NaN (0x7F/0xFF), +-448 (0x7E/0xFE),
    +-0, the smallest subnormals and the largest subnormal."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    special = torch.tensor(
        [0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08], dtype=torch.uint8
    )
    raw.view(-1)[: special.numel()] = special
    raw.view(-1)[-special.numel() :] = special
    return raw.view(torch.float8_e4m3fn)


def _scales(sr: int, sc: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(sr, sc, generator=gen) * torch.logspace(-40, 3, sr * sc).view(sr, sc)
    s.view(-1)[0] = 0.0  # zero scale (a block that was all zeros)
    if s.numel() > 2:
        s.view(-1)[1] = 1e-41  # float32 subnormal scale
        s.view(-1)[2] = 3.0e38  # products overflow to inf
    return s


def _same(a: torch.Tensor, b: torch.Tensor, bits: torch.dtype) -> None:
    assert a.shape == b.shape
    diff = (a.view(bits) != b.view(bits)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} elements differ, first at {diff[0].tolist()}"


@pytest.mark.parametrize(("dtype", "name", "bits"), OUT)
def test_fp8_whole_tensor_matches_transformers(dtype: torch.dtype, name: str, bits: torch.dtype) -> None:
    w = _fp8_weight(384, 512, seed=1)
    s = _scales(3, 4, seed=2)
    ref = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=dtype)
    out = torch.empty(384, 512, dtype=dtype)
    _run([_op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F32"), out, (1, 384, 512), (128, 128))])
    _same(out, ref, bits)
    assert torch.isnan(ref).any() and torch.isinf(ref).any() and (ref == 0).any()


@pytest.mark.parametrize(("dtype", "name", "bits"), OUT[:2])
@pytest.mark.parametrize(
    "box",
    [
        (77, 100, 0, 512),
        (0, 384, 130, 126),
        (127, 2, 127, 2),
        (200, 184, 300, 212),
        (383, 1, 511, 1),
        (5, 0, 0, 7),
    ],
)
def test_fp8_sub_boxes_starting_inside_a_block(
    dtype: torch.dtype, name: str, bits: torch.dtype, box: tuple[int, int, int, int]
) -> None:
    w = _fp8_weight(384, 512, seed=3)
    s = _scales(3, 4, seed=4)
    ref = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=dtype)
    r0, nr, c0, nc = box
    out = torch.full((nr, nc), 7.0, dtype=dtype)
    _run([_op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F32"), out, (1, 384, 512), (128, 128),
              box=(0, 1, r0, nr, c0, nc))])  # fmt: skip
    _same(out, ref[r0 : r0 + nr, c0 : c0 + nc], bits)


def _block_reference(
    w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Fp8Dequantize's arithmetic (fp32 product, one rounding) on the ceil-block
    grid: transformers derives the block from the grid, which only agrees with
    the configured block when the shape divides it."""
    rows, cols = w.shape
    full = s.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (w.float() * full).to(dtype)


@pytest.mark.parametrize(("dtype", "name", "bits"), OUT)
def test_fp8_uneven_shapes_use_the_configured_block(dtype: torch.dtype, name: str, bits: torch.dtype) -> None:
    rows, cols = 300, 200  # neither divides 128: scale grid [3, 2]
    w = _fp8_weight(rows, cols, seed=5)
    s = _scales(3, 2, seed=6)
    ref = _block_reference(w, s, (128, 128), dtype)
    out = torch.empty(rows, cols, dtype=dtype)
    _run([_op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F32"), out, (1, rows, cols), (128, 128))])
    nan = torch.isnan(ref)
    assert torch.equal(nan, torch.isnan(out))
    _same(out[~nan], ref[~nan], bits)  # torch.to's NaN bits for the reference's path are its own
    # The same shape where it divides the grid evenly agrees with transformers itself.
    w2, s2 = _fp8_weight(256, 256, seed=7), _scales(2, 2, seed=8)
    _same(_block_reference(w2, s2, (128, 128), dtype), Fp8Dequantize(None)._dequantize_one(w2, s2, output_dtype=dtype),
          bits)  # fmt: skip


def test_fp8_scale_dtypes_bf16_and_e8m0() -> None:
    w = _fp8_weight(256, 256, seed=9)
    for sdt, sname in [(torch.bfloat16, "BF16"), (torch.uint8, "U8"), (torch.float8_e8m0fnu, "F8_E8M0")]:
        gen = torch.Generator().manual_seed(10)
        s = torch.randint(100, 140, (2, 2), generator=gen, dtype=torch.uint8)
        s = s.view(sdt) if sdt != torch.bfloat16 else torch.rand(2, 2, generator=gen).to(torch.bfloat16)
        ref = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.float32)
        out = torch.empty(256, 256)
        _run([_op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, sname), out, (1, 256, 256), (128, 128))])
        _same(out, ref, torch.int32)


def test_fp8_experts_fuse_into_a_stacked_concatenated_destination() -> None:
    """Per-expert gate/up [I, H] weights into gate_up_proj [E, 2I, H], and a
    rank's shard of rows 50..150 of that fused tensor (crossing gate -> up)."""
    n_exp, inter, hidden = 3, 96, 256
    ws = [[_fp8_weight(inter, hidden, seed=20 + 2 * e + k) for k in range(2)] for e in range(n_exp)]
    ss = [[_scales(1, 2, seed=40 + 2 * e + k) for k in range(2)] for e in range(n_exp)]
    ref = torch.stack([
        torch.cat([Fp8Dequantize(None)._dequantize_one(ws[e][k], ss[e][k], output_dtype=torch.bfloat16)
                   for k in range(2)]) for e in range(n_exp)
    ])  # fmt: skip
    fused = torch.empty(n_exp, 2 * inter, hidden, dtype=torch.bfloat16)
    rows = [
        _op("fp8_block", _mem(ws[e][k], "F8_E4M3"), _mem(ss[e][k], "F32"), fused, (1, inter, hidden), (128, 128),
            dst_offset=(e * 2 * inter + k * inter) * hidden, dst_strides=(0, hidden, 1))
        for e in range(n_exp) for k in range(2)
    ]  # fmt: skip
    _run(rows)
    _same(fused, ref, torch.int16)
    shard = torch.empty(n_exp, 100, hidden, dtype=torch.bfloat16)  # fused rows 50..150
    rows = []
    for e in range(n_exp):
        rows.append(_op("fp8_block", _mem(ws[e][0], "F8_E4M3"), _mem(ss[e][0], "F32"), shard, (1, inter, hidden),
                        (128, 128), box=(0, 1, 50, 46, 0, hidden), dst_offset=e * 100 * hidden,
                        dst_strides=(0, hidden, 1)))  # fmt: skip
        rows.append(_op("fp8_block", _mem(ws[e][1], "F8_E4M3"), _mem(ss[e][1], "F32"), shard, (1, inter, hidden),
                        (128, 128), box=(0, 1, 0, 54, 0, hidden), dst_offset=(e * 100 + 46) * hidden,
                        dst_strides=(0, hidden, 1)))  # fmt: skip
    _run(rows)
    _same(shard, ref[:, 50:150], torch.int16)


def test_fp8_large_op_splits_across_threads_identically() -> None:
    w = _fp8_weight(1536, 2048, seed=11)  # 6 MiB of bf16: several pieces
    s = _scales(12, 16, seed=12)
    ref = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.bfloat16)
    for threads in (1, 2, 4):
        out = torch.empty(1536, 2048, dtype=torch.bfloat16)
        _run([_op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F32"), out, (1, 1536, 2048), (128, 128))],
             engine=native.CopyEngine(threads))  # fmt: skip
        _same(out, ref, torch.int16)


@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_fp8_from_files_in_both_read_modes(tmp_path: Path, mode: str) -> None:
    w = _fp8_weight(300, 260, seed=13)
    s = _scales(3, 3, seed=14)
    path = tmp_path / "q.safetensors"
    save_file({"a.weight": w, "a.weight_scale_inv": s, "b": torch.ones(5)}, str(path))
    sf = native.SafetensorsFile(str(path), mode)
    ent = {e[0]: e for e in sf.tensors}
    wb, we = ent["a.weight"][3:5]
    sb, se = ent["a.weight_scale_inv"][3:5]
    ref = _block_reference(w, s, (128, 128), torch.bfloat16)
    for box in [(0, 1, 0, 300, 0, 260), (0, 1, 129, 100, 3, 250), (0, 1, 299, 1, 0, 260)]:
        out = torch.empty(box[3], box[5], dtype=torch.bfloat16)
        n = _run([_op("fp8_block", (0, wb, we - wb, "F8_E4M3"), (0, sb, se - sb, "F32"), out, (1, 300, 260),
                      (128, 128), box=box)], files=[sf])  # fmt: skip
        want = ref[box[2] : box[2] + box[3], box[4] : box[4] + box[5]]
        nan = torch.isnan(want)
        assert torch.equal(nan, torch.isnan(out)) and torch.equal(
            out[~nan].view(torch.int16), want[~nan].view(torch.int16)
        )
        # Only the rows the box covers are read: weight bytes ~ box rows x row span.
        assert n <= box[3] * 260 + 4 * 3 * 3 * 2


def test_bad_ops_are_named_errors_and_write_nothing() -> None:
    w = _fp8_weight(128, 128, seed=15)
    s = _scales(1, 1, seed=16)
    out = torch.full((128, 128), 5.0)
    good = _op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F32"), out, (1, 128, 128), (128, 128))
    cases = {
        "outside the tensor": _op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F32"), out, (1, 128, 128), (128, 128),
                                  box=(0, 1, 100, 29, 0, 128)),
        "writes outside the destination": _op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F32"), out, (1, 128, 128),
                                              (128, 128), dst_offset=1),
        "scale tensor has 4 bytes, the shape needs 8": _op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F32"), out,
                                                           (1, 128, 128), (128, 64)),
        "FP8 weights must be F8_E4M3 or F8_E5M2": _op("fp8_block", _mem(w, "U8"), _mem(s, "F32"), out,
                                                      (1, 128, 128), (128, 128)),
        "weight tensor has 16384 bytes, the shape needs 32768": _op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F32"),
                                                                    out, (1, 256, 128), (256, 128)),
    }  # fmt: skip
    for why, row in cases.items():
        with pytest.raises(CopyOpError, match=f"dequant op 1: .*{why}"):
            _run([good, row])
        assert (out == 5.0).all(), why


# ---------------------------------------------------------------- MXFP4


def _mxfp4(experts: int, rows: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 256, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    scales.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: scales.numel()]  # every exponent
    return blocks, scales


@pytest.mark.parametrize(("dtype", "name", "bits"), OUT)
def test_mxfp4_matches_convert_moe_packed_tensors(dtype: torch.dtype, name: str, bits: torch.dtype) -> None:
    n_exp, rows, groups = 3, 24, 4  # rows = 2I (gate/up interleaved), cols H = groups * 32
    blocks, scales = _mxfp4(n_exp, rows, groups, seed=17)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, H, 2I]: transposed
    hidden = groups * 32
    out = torch.empty(n_exp, hidden, rows, dtype=dtype)
    _run([_op("mxfp4", _mem(blocks, "U8"), _mem(scales, "U8"), out, (n_exp, rows, hidden), (1, 32),
              dst_strides=(hidden * rows, 1, rows))])  # fmt: skip
    _same(out, ref, bits)


def test_mxfp4_sub_boxes_of_the_transposed_layout() -> None:
    """A rank's shard of the transformers layout [E, H, 2I] sharded on dim 0
    (experts) or dim 1 (H, i.e. value columns starting mid-group)."""
    n_exp, rows, groups = 4, 20, 3
    blocks, scales = _mxfp4(n_exp, rows, groups, seed=18)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    hidden = groups * 32
    for b0, nb, c0, nc in [(1, 2, 0, hidden), (0, 4, 45, 30), (3, 1, 95, 1), (0, 4, 1, 63)]:
        out = torch.empty(nb, nc, rows, dtype=torch.bfloat16)
        _run([_op("mxfp4", _mem(blocks, "U8"), _mem(scales, "U8"), out, (n_exp, rows, hidden), (1, 32),
                  box=(b0, nb, 0, rows, c0, nc), dst_strides=(nc * rows, 1, rows))])  # fmt: skip
        _same(out, ref[b0 : b0 + nb, c0 : c0 + nc], torch.int16)


@pytest.mark.parametrize(("dtype", "name", "bits"), OUT)
def test_mxfp4_row_tiles_and_the_plain_layout(dtype: torch.dtype, name: str, bits: torch.dtype) -> None:
    """More rows than one tile of the transposed path (150: two tiles of 64 and a short one),
    boxes of rows and of mid-group columns, and the untransposed [E, 2I, H] layout (rows along
    the destination's rows), whole and boxed, against transformers."""
    n_exp, rows, groups = 3, 150, 3
    blocks, scales = _mxfp4(n_exp, rows, groups, seed=21)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, H, 2I]
    hidden = groups * 32
    for b0, nb, r0, nr, c0, nc in [
        (0, 3, 0, rows, 0, hidden),
        (1, 2, 37, 100, 33, 50),
        (2, 1, 64, 86, 95, 1),
    ]:
        out = torch.empty(nb, nc, nr, dtype=dtype)
        _run([_op("mxfp4", _mem(blocks, "U8"), _mem(scales, "U8"), out, (n_exp, rows, hidden), (1, 32),
                  box=(b0, nb, r0, nr, c0, nc), dst_strides=(nc * nr, 1, nr))])  # fmt: skip
        _same(out, ref[b0 : b0 + nb, c0 : c0 + nc, r0 : r0 + nr], bits)
        plain = torch.empty(nb, nr, nc, dtype=dtype)
        _run([_op("mxfp4", _mem(blocks, "U8"), _mem(scales, "U8"), plain, (n_exp, rows, hidden), (1, 32),
                  box=(b0, nb, r0, nr, c0, nc))])  # fmt: skip
        _same(plain, ref[b0 : b0 + nb, c0 : c0 + nc, r0 : r0 + nr].transpose(1, 2), bits)


@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_mxfp4_from_files(tmp_path: Path, mode: str) -> None:
    n_exp, rows, groups = 2, 16, 2
    blocks, scales = _mxfp4(n_exp, rows, groups, seed=19)
    path = tmp_path / "m.safetensors"
    save_file({"x.gate_up_proj_blocks": blocks, "x.gate_up_proj_scales": scales}, str(path))
    sf = native.SafetensorsFile(str(path), mode)
    ent = {e[0]: e for e in sf.tensors}
    bb, be = ent["x.gate_up_proj_blocks"][3:5]
    sb, se = ent["x.gate_up_proj_scales"][3:5]
    hidden = groups * 32
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    out = torch.empty(n_exp, hidden, rows)
    _run([_op("mxfp4", (0, bb, be - bb, "U8"), (0, sb, se - sb, "U8"), out, (n_exp, rows, hidden), (1, 32),
              dst_strides=(hidden * rows, 1, rows))], files=[sf])  # fmt: skip
    _same(out, ref, torch.int32)


@pytest.mark.parametrize(("dtype", "name", "bits"), OUT)
def test_fp8_e8m0_scales_all_256_values_match_torch(dtype: torch.dtype, name: str, bits: torch.dtype) -> None:
    """Every float8_e8m0fnu scale byte, 0xFF (NaN, widened by torch to
    0x7F800001) included, times fp8 values (a NaN among them): the products'
    bits, NaN payloads included, are torch's and transformers'."""
    s = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).reshape(256, 1)
    w = torch.tensor([0x38, 0xC0, 0x00, 0x80, 0x7F, 0x01], dtype=torch.uint8)  # 1, -2, +-0, NaN, subnormal
    w = w.repeat(256, 1).view(torch.float8_e4m3fn)
    out = torch.empty(256, 6, dtype=dtype)
    _run([_op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, "F8_E8M0"), out, (1, 256, 6), (1, 6))])
    want = (w.to(torch.float32) * s.to(torch.float32)).to(dtype)
    _same(out, want, bits)
    _same(out, Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=dtype), bits)


TABLE_MIN = int(ext.DEQUANT_TABLE_MIN)
OUT64 = [*OUT, (torch.float64, "F64", torch.int64)]


@pytest.mark.parametrize("wname", ["F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize(("dtype", "name", "bits"), OUT64)
def test_fp8_block_tables_match_torch_for_every_byte_and_scale(
    dtype: torch.dtype, name: str, bits: torch.dtype, wname: str
) -> None:
    """Blocks just large enough to be dequantized through a table of their 256 outputs
    (DEQUANT_TABLE_MIN elements): every fp8 byte (NaNs and infs included) under every
    float8_e8m0fnu scale (the NaN one included), into a contiguous destination, a transposed
    one (column stride > 1) and a box whose first and last blocks are too thin for a table
    (computed element by element)."""
    block = (TABLE_MIN // 256, 256)
    assert block[0] * block[1] == TABLE_MIN
    wdt = torch.float8_e4m3fn if wname == "F8_E4M3" else torch.float8_e5m2
    w = torch.arange(256, dtype=torch.uint8).repeat(256 * block[0], 1).view(wdt)
    s = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).reshape(256, 1)
    rows, cols = w.shape
    want = (w.to(torch.float32) * s.to(torch.float32).repeat_interleave(block[0], 0)).to(dtype)
    assert torch.isnan(want).any() and torch.isinf(want).any()
    out = torch.empty(rows, cols, dtype=dtype)
    _run([_op("fp8_block", _mem(w, wname), _mem(s, "F8_E8M0"), out, (1, rows, cols), block)])
    _same(out, want, bits)
    out_t = torch.empty(cols, rows, dtype=dtype)
    _run([_op("fp8_block", _mem(w, wname), _mem(s, "F8_E8M0"), out_t, (1, rows, cols), block,
              dst_strides=(0, 1, rows))])  # fmt: skip
    _same(out_t.T, want, bits)
    r0, nr = (
        3,
        rows - 3 - (block[0] - 3),
    )  # a thin first block (block[0] - 3 rows) and a thin last one (3 rows)
    part = torch.full((nr, cols), 7.0, dtype=dtype)
    _run([_op("fp8_block", _mem(w, wname), _mem(s, "F8_E8M0"), part, (1, rows, cols), block,
              box=(0, 1, r0, nr, 0, cols))])  # fmt: skip
    _same(part, want[r0 : r0 + nr], bits)


def _nan_scales(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random positive scales of ``dtype`` with NaNs (payloads, a negative one), infs and zeros."""
    gen = torch.Generator().manual_seed(seed)
    s = (torch.rand(shape, generator=gen) * 4).to(dtype)
    ibits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    specials = {
        torch.float32: [
            0x7FC00001,
            0x7F800123,
            -0x00400001,
            0x7F800000,
            0,
        ],  # qNaN+payload, sNaN, -NaN, inf, 0
        torch.bfloat16: [0x7FC1, 0x7F81, -0x003F, 0x7F80, 0],
        torch.float16: [0x7E01, 0x7C01, -0x01FF, 0x7C00, 0],
    }[dtype]
    flat = s.view(ibits).view(-1)
    for i, v in enumerate(specials):
        flat[3 * i + 1] = v
    return s


@pytest.mark.parametrize(
    ("sdt", "sname"), [(torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.float16, "F16")]
)
@pytest.mark.parametrize(("dtype", "name", "bits"), OUT64)
def test_fp8_tables_equal_the_element_wise_path(
    sdt: torch.dtype, sname: str, dtype: torch.dtype, name: str, bits: torch.dtype
) -> None:
    """The tabled blocks against the same op run one row at a time (every block region then
    below DEQUANT_TABLE_MIN: element by element), bit for bit: scales with NaN payloads, infs
    and zeros in each scale dtype, two batch items, a block height (48) that does not divide
    the rows, a box starting and ending inside blocks, pieces of 1-3 threads starting inside
    row blocks, and a destination with its columns reversed (negative stride)."""
    batch, rows, cols, block = 2, 1000, 640, (48, 128)
    assert block[1] < TABLE_MIN  # one row of a block is computed element by element
    gen = torch.Generator().manual_seed(31)
    w = torch.randint(0, 256, (batch, rows, cols), generator=gen, dtype=torch.uint8)
    w[..., :256] = torch.arange(256, dtype=torch.uint8)  # every byte in every row
    w = w.view(torch.float8_e4m3fn)
    s = _nan_scales((batch, -(-rows // block[0]), cols // block[1]), sdt, seed=32)
    b0, nb, r0, nr, c0, nc = 0, batch, 5, 990, 3, 630
    for reverse in (False, True):
        stride_c = -1 if reverse else 1
        strides = (nr * nc, nc, stride_c)
        first = nc - 1 if reverse else 0  # where column c0 lands
        tabled = torch.empty(nb, nr, nc, dtype=dtype)
        for threads in (1, 2, 3):
            tabled.fill_(7.0)
            _run([_op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, sname), tabled, (batch, rows, cols), block,
                      box=(b0, nb, r0, nr, c0, nc), dst_offset=first, dst_strides=strides)],
                 engine=native.CopyEngine(threads))  # fmt: skip
            by_row = torch.full((nb, nr, nc), 7.0, dtype=dtype)
            ops = [
                _op("fp8_block", _mem(w, "F8_E4M3"), _mem(s, sname), by_row, (batch, rows, cols), block,
                    box=(b, 1, r, 1, c0, nc), dst_offset=(b - b0) * nr * nc + (r - r0) * nc + first,
                    dst_strides=strides)
                for b in range(b0, b0 + nb) for r in range(r0, r0 + nr)
            ]  # fmt: skip
            _run(ops)
            _same(tabled, by_row, bits)
        assert torch.isnan(by_row).any() and torch.isinf(by_row).any()


def test_mxfp4_transposed_tiles_equal_the_plain_path() -> None:
    """The transposed path (tiles of 64 rows, column by column) against the untransposed one
    (row by row), bit for bit: float8_e8m0fnu scales shared by 4 rows, more rows than one
    piece (two pieces per expert, also from a box starting at row 1001), mid-group columns,
    and a padded destination (column stride > the rows)."""
    n_exp, rows, groups, block = 2, 40_000, 2, (4, 32)
    gen = torch.Generator().manual_seed(33)
    blocks = torch.randint(0, 256, (n_exp, rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 160, (n_exp, rows // block[0], groups), generator=gen, dtype=torch.uint8)
    scales.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every exponent, 0xFF (NaN) included
    scales = scales.view(torch.float8_e8m0fnu)
    hidden = groups * 32
    for b0, nb, r0, nr, c0, nc in [
        (0, n_exp, 0, rows, 0, hidden),
        (1, 1, 1001, 38_000, 0, hidden),
        (0, 2, 7, 500, 17, 40),
    ]:
        plain = torch.empty(nb, nr, nc, dtype=torch.bfloat16)
        _run([_op("mxfp4", _mem(blocks, "U8"), _mem(scales, "F8_E8M0"), plain, (n_exp, rows, hidden), block,
                  box=(b0, nb, r0, nr, c0, nc))])  # fmt: skip
        pad = nr + 3
        out = torch.full((nb, nc, pad), 7.0, dtype=torch.bfloat16)
        _run([_op("mxfp4", _mem(blocks, "U8"), _mem(scales, "F8_E8M0"), out, (n_exp, rows, hidden), block,
                  box=(b0, nb, r0, nr, c0, nc), dst_strides=(nc * pad, 1, pad))])  # fmt: skip
        _same(out[:, :, :nr].transpose(1, 2), plain, torch.int16)
        assert (out[:, :, nr:] == 7.0).all()  # the padding is not written
