"""The native copy engine against torch: strided regions and every cast."""

from __future__ import annotations

import itertools

import pytest
import torch

from streamload.errors import CopyOpError
from streamload.io import _native
from streamload.io.copy_ops import ST_DTYPES, OpBatch, bit_view, can_convert

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(4000, generator=gen, dtype=torch.float64) * torch.logspace(
        -12, 12, 4000, dtype=torch.float64
    )
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            65504.0,
            65520.0,
            70000.0,
            6e-8,
            3e-8,
            1e-45,
            3.3895e38,
            3.4e38,
            1.0 + 2**-8,
            1.0 + 3 * 2**-9,
            1.0 + 2**-11,
            1.0 + 2**-12,
        ],
        dtype=torch.float64,
    )
    # Halfway cases for every narrowing: round-to-nearest-even must match torch.
    ties = torch.arange(0, 2**16, 97, dtype=torch.int64).to(torch.int32)
    bf_ties = ((ties << 16) | 0x8000).view(torch.float32).to(torch.float64)
    vals = torch.cat([base, specials, -specials, bf_ties])
    vals = vals[~torch.isnan(vals) | (torch.arange(len(vals)) % 2 == 0)]
    return vals.to(dtype)


def _run(
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    shape,
    src_strides,
    dst_strides,
    src_offset=0,
    dst_offset=0,
    threads: int = 2,
) -> None:
    batch = OpBatch()
    batch.add(
        file=-1,
        src=src.data_ptr(),
        src_nbytes=src.numel() * src.element_size(),
        src_dtype=ST_DTYPES[src.dtype],
        dst=dst,
        dst_dtype=ST_DTYPES[dst.dtype],
        shape=shape,
        src_strides=src_strides,
        dst_strides=dst_strides,
        src_offset=src_offset,
        dst_offset=dst_offset,
    )
    batch.execute(_native.CopyEngine(threads), [])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN equals any NaN (torch's own NaN
    payloads differ between its scalar and vector paths)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a.float()) if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    if not torch.equal(nan, torch.isnan(b.float()) if b.is_floating_point() else nan):
        return False
    return torch.equal(bit_view(a[~nan]), bit_view(b[~nan]))


@pytest.mark.parametrize("src_dtype,dst_dtype", list(itertools.product(FLOATS, FLOATS)))
def test_casts_match_torch(src_dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    src = _special_values(src_dtype)
    dst = torch.empty(src.shape, dtype=dst_dtype)
    _run(src, dst, shape=[src.numel()], src_strides=[1], dst_strides=[1])
    assert _same(dst, src.to(dst_dtype))


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.uint16,
        torch.int32,
        torch.uint32,
        torch.int64,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
)
def test_identity_copies_every_dtype(dtype: torch.dtype) -> None:
    src = torch.randint(0, 120, (6, 9), dtype=torch.int64).to(dtype)
    dst = torch.zeros((3, 9), dtype=dtype)
    _run(src, dst, shape=[3, 9], src_strides=[18, 1], dst_strides=[9, 1], src_offset=9)
    assert torch.equal(dst.view(torch.uint8), src[1::2].contiguous().view(torch.uint8))


@pytest.mark.parametrize(
    "src_dtype,dst_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.float32, torch.float16)],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_strided_regions(src_dtype: torch.dtype, dst_dtype: torch.dtype, threads: int) -> None:
    gen = torch.Generator().manual_seed(5)
    src = torch.randn(11, 13, 7, 3, generator=gen).to(src_dtype)
    cases = [
        (slice(2, 9), slice(0, 13), slice(1, 6), slice(0, 3)),  # inner box
        (slice(0, 11), slice(4, 5), slice(0, 7), slice(2, 3)),  # single column
        (slice(10, 11), slice(0, 13), slice(0, 7), slice(0, 3)),  # one outer row
        (slice(0, 11), slice(0, 13), slice(0, 7), slice(0, 3)),  # whole
        (slice(3, 3), slice(0, 13), slice(0, 7), slice(0, 3)),  # empty
    ]
    for box in cases:
        view = src[box]
        # Write the region into the middle of a larger, transposed-layout buffer.
        dst_full = torch.full(
            (view.shape[3], view.shape[0] + 2, view.shape[1], view.shape[2]), 7.0, dtype=dst_dtype
        )
        target = dst_full[:, 1 : 1 + view.shape[0]].permute(1, 2, 3, 0)
        st = dst_full.stride()
        _run(
            src,
            dst_full,
            shape=list(view.shape),
            src_strides=list(src.stride()),
            dst_strides=[st[1], st[2], st[3], st[0]],
            src_offset=view.storage_offset(),
            dst_offset=st[1],
            threads=threads,
        )
        assert _same(target.contiguous(), view.to(dst_dtype).contiguous()), box
        untouched = torch.cat([dst_full[:, :1].reshape(-1), dst_full[:, 1 + view.shape[0] :].reshape(-1)])
        assert bool((untouched == 7.0).all())


def test_zero_dim_and_large_split() -> None:
    src = torch.tensor(3.5, dtype=torch.bfloat16)
    dst = torch.zeros((), dtype=torch.float32)
    _run(src, dst, shape=[], src_strides=[], dst_strides=[])
    assert dst.item() == 3.5
    big = torch.randn(3000, 1000).to(torch.bfloat16)  # > one 4 MiB piece: split across threads
    out = torch.empty(3000, 1000)
    _run(big, out, shape=[3000, 1000], src_strides=[1000, 1], dst_strides=[1000, 1])
    assert torch.equal(out, big.float())


def test_many_ops_in_one_call() -> None:
    src = torch.arange(5000, dtype=torch.float32)
    dst = torch.zeros(5000, dtype=torch.bfloat16)
    batch = OpBatch()
    for i in range(0, 5000, 5):
        batch.add(
            file=-1,
            src=src.data_ptr(),
            src_nbytes=src.numel() * 4,
            src_dtype="F32",
            dst=dst,
            dst_dtype="BF16",
            shape=[5],
            src_strides=[1],
            dst_strides=[1],
            src_offset=i,
            dst_offset=i,
        )
    assert len(batch) == 1000
    assert batch.execute(_native.CopyEngine(0), []) == 5000 * 4
    assert torch.equal(dst, src.to(torch.bfloat16))


def test_out_of_bounds_ops_write_nothing() -> None:
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(8, dtype=torch.float32)
    good = dict(
        file=-1,
        src=src.data_ptr(),
        src_nbytes=64,
        src_dtype="F32",
        dst=dst,
        dst_dtype="F32",
        src_strides=[1],
        dst_strides=[1],
    )
    for bad in [
        dict(shape=[9]),
        dict(shape=[8], dst_offset=1),
        dict(shape=[8], src_offset=9),
        dict(shape=[2], src_strides=[16]),
    ]:
        batch = OpBatch()
        batch.add(**{**good, "shape": [4]})  # a valid op first: it must not run either
        batch.add(**{**good, **bad})
        with pytest.raises(CopyOpError):
            batch.execute(_native.CopyEngine(2), [])
        assert bool((dst == 0).all())
    batch = OpBatch()
    batch.add(**{**good, "shape": [4], "dst_dtype": "I32"})
    with pytest.raises(CopyOpError, match="no conversion"):
        batch.execute(_native.CopyEngine(1), [])
    assert not can_convert("F32", "I32") and can_convert("BF16", "F64")
