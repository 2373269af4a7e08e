"""The native core against safetensors and torch: every dtype the format
defines parses, sub-byte dtypes copy as bytes, fp8 widens exactly as torch
casts, and a pool opened before fork() works in the child."""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from forking import wait_for_child
from safetensors import safe_open
from safetensors.torch import save_file

try:
    from streamload.io import _native as native
except ImportError:
    from streamload import _native as native
from streamload.errors import CopyOpError, DTypeMismatchError, HeaderError

ext = native._ext
CODES: dict[str, int] = dict(ext.DTYPE_CODES)

# Every dtype name the installed safetensors accepts in a header (its Rust enum).
SAFETENSORS_DTYPES = [
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
    "C64", "F64", "I64", "U64",
]  # fmt: skip
BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _bits(name: str) -> int:
    if name in BITS:
        return BITS[name]
    digits = "".join(c for c in name.split("_")[0] if c.isdigit())
    return 8 if name == "BOOL" else int(digits)


def _file_bytes(entries: list[tuple[str, str, list[int], int]], fill: int = 0) -> bytes:
    """A safetensors file built by hand: (name, dtype, shape, nbytes) per tensor."""
    header: dict[str, object] = {}
    off = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = bytes((i * 37 + fill) % 256 for i in range(off))
    return struct.pack("<Q", len(text)) + text + data


def _copy_row(
    src: int, src_nbytes: int, src_dtype: str, dst: int, dst_nbytes: int, dst_dtype: str, shape: list[int],
    src_strides: list[int], dst_strides: list[int], file: int = -1, src_offset: int = 0, dst_offset: int = 0,
) -> list[int]:  # fmt: skip
    nd = len(shape)
    pad = [0] * (native.MAX_DIMS - nd)
    return [
        file, src, src_nbytes, CODES[src_dtype], dst, dst_nbytes, CODES[dst_dtype], nd, src_offset, dst_offset,
        *shape, *pad, *src_strides, *pad, *dst_strides, *pad,
    ]  # fmt: skip


def _execute(engine: object, files: list[object], rows: list[list[int]]) -> int:
    arr = np.ascontiguousarray(np.array(rows, dtype=np.int64))
    assert arr.shape[1] == native.OP_FIELDS
    return engine.execute(files, arr.ctypes.data, arr.nbytes)  # type: ignore[attr-defined]


def test_codes_cover_every_safetensors_dtype() -> None:
    assert sorted(SAFETENSORS_DTYPES) == sorted(CODES)
    # Codes that existed before stay put (they cross the Python boundary).
    old = ["BOOL", "U8", "I8", "U16", "I16", "F16", "BF16", "U32", "I32", "F32", "U64", "I64", "F64"]
    assert [CODES[n] for n in old + ["F8_E4M3", "F8_E5M2"]] == list(range(15))


def _torch_savable() -> list[torch.dtype]:
    from safetensors import torch as st_torch

    return [d for d in st_torch._SIZE if d is not None]


@pytest.mark.parametrize("dtype", _torch_savable(), ids=str)
def test_every_torch_dtype_safetensors_saves_parses_and_copies(tmp_path: Path, dtype: torch.dtype) -> None:
    raw = torch.arange(48 * 8, dtype=torch.int64).mul(2654435761).remainder(256).to(torch.uint8)
    t = raw[: 48 * torch.empty((), dtype=dtype).element_size()].view(dtype).reshape(6, -1)
    path = tmp_path / "one.safetensors"
    save_file({"t": t, "pad": torch.ones(3)}, str(path))
    with safe_open(str(path), "pt") as f:
        st_dtype = f.get_slice("t").get_dtype()
    for mode in ("mmap", "pread"):
        sf = native.SafetensorsFile(str(path), mode)
        (name, got_dtype, shape, begin, end) = next(e for e in sf.tensors if e[0] == "t")
        # float4_e2m1fn_x2 holds two F4 values per element: the file counts values.
        want = list(t.shape[:-1]) + [t.shape[-1] * (2 if got_dtype == "F4" else 1)]
        assert got_dtype == st_dtype and list(shape) == want
        out = torch.empty(t.shape, dtype=dtype)
        n = int(np.prod(want))
        _execute(
            native.CopyEngine(2), [sf],
            [_copy_row(begin, end - begin, got_dtype, out.data_ptr(), out.nbytes, got_dtype, [n], [1], [1], file=0)],
        )  # fmt: skip
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("dtype", SAFETENSORS_DTYPES)
def test_hand_built_header_of_every_dtype(tmp_path: Path, dtype: str) -> None:
    bits = _bits(dtype)
    numel = 16  # whole bytes for every width
    data = _file_bytes([("a", dtype, [4, 4], numel * bits // 8), ("b", "F32", [2], 8)])
    table, _, _ = native.parse_header(data)
    assert [(e[0], e[1], list(e[2])) for e in table] == [("a", dtype, [4, 4]), ("b", "F32", [2])]
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), "pt") as f:  # the reference accepts the same file
        assert f.get_slice("a").get_dtype() == dtype


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes"),
    [("F4", [3], 2), ("F4", [1], 1), ("F6_E2M3", [3], 3), ("F6_E3M2", [5, 1], 4), ("F4", [4], 3)],
)
def test_sub_byte_sizes_follow_safetensors(tmp_path: Path, dtype: str, shape: list[int], nbytes: int) -> None:
    data = _file_bytes([("t", dtype, shape, nbytes)])
    with pytest.raises(HeaderError) as err:
        native.parse_header(data)
    assert err.value.tensor == "t"
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(Exception), safe_open(str(path), "pt") as f:  # noqa: B017 - safetensors' own error type
        f.get_slice("t")


def test_sub_byte_regions_copy_as_bytes_or_fail_clearly(tmp_path: Path) -> None:
    path = tmp_path / "f4.safetensors"
    path.write_bytes(_file_bytes([("w", "F4", [6, 8], 24), ("s", "F6_E2M3", [4, 4], 12)]))
    sf = native.SafetensorsFile(str(path), "mmap")
    entries = {e[0]: e for e in sf.tensors}
    whole = bytes(path.read_bytes()[sf.data_start :])
    eng = native.CopyEngine(2)
    _, _, _, wb, we = entries["w"]
    out = np.zeros(24, dtype=np.uint8)
    _execute(eng, [sf], [_copy_row(wb, we - wb, "F4", out.ctypes.data, 24, "F4", [48], [1], [1], file=0)])
    assert out.tobytes() == whole[wb:we]
    # Rows 2..4, columns 2..6 of the [6, 8] nibble grid: every edge on a byte.
    out2 = np.zeros(6, dtype=np.uint8)
    row = _copy_row(
        wb, we - wb, "F4", out2.ctypes.data, 6, "F4", [3, 4], [8, 1], [4, 1], file=0, src_offset=18
    )
    _execute(eng, [sf], [row])
    grid = np.frombuffer(whole[wb:we], dtype=np.uint8).reshape(6, 4)
    assert out2.tobytes() == grid[2:5, 1:3].tobytes()
    # Starting at nibble 1 is inside a byte: a clear error, nothing written.
    out3 = np.full(6, 0xAB, dtype=np.uint8)
    bad = _copy_row(
        wb, we - wb, "F4", out3.ctypes.data, 6, "F4", [3, 4], [8, 1], [4, 1], file=0, src_offset=17
    )
    with pytest.raises(
        CopyOpError, match="F4 is 4-bit and is copied as bytes: the source offset is not byte-aligned"
    ):
        _execute(eng, [sf], [bad])
    assert (out3 == 0xAB).all()
    # F6 rows of 4 values are 3 bytes: whole rows copy, odd columns do not.
    _, _, _, sb, se = entries["s"]
    out4 = np.zeros(6, dtype=np.uint8)
    _execute(eng, [sf], [_copy_row(sb, se - sb, "F6_E2M3", out4.ctypes.data, 6, "F6_E2M3", [2, 4], [4, 1], [4, 1],
                                   file=0, src_offset=8)])  # fmt: skip
    assert out4.tobytes() == whole[sb + 6 : sb + 12]
    with pytest.raises(CopyOpError, match="innermost extent is not byte-aligned"):
        _execute(eng, [sf], [_copy_row(sb, se - sb, "F6_E2M3", out4.ctypes.data, 6, "F6_E2M3", [2, 3], [4, 1],
                                       [3, 1], file=0)])  # fmt: skip
    with pytest.raises(CopyOpError, match="no conversion from F4 to BF16"):
        _execute(
            eng, [sf], [_copy_row(wb, we - wb, "F4", out.ctypes.data, 24, "BF16", [4], [1], [1], file=0)]
        )


FP8 = [(torch.float8_e4m3fn, "F8_E4M3"), (torch.float8_e5m2, "F8_E5M2")]
WIDE = [
    (torch.bfloat16, "BF16", torch.int16),
    (torch.float16, "F16", torch.int16),
    (torch.float32, "F32", torch.int32),
    (torch.float64, "F64", torch.int64),
]


@pytest.mark.parametrize(("fp8", "fp8_name"), FP8)
@pytest.mark.parametrize(("wide", "wide_name", "bits"), WIDE)
def test_fp8_casts_every_byte_like_torch(
    fp8: torch.dtype, fp8_name: str, wide: torch.dtype, wide_name: str, bits: torch.dtype
) -> None:
    src = torch.arange(256, dtype=torch.uint8).repeat(3).view(fp8)  # 768: past one vector width
    ref = src.to(wide)
    out = torch.empty(src.shape, dtype=wide)
    _execute(native.CopyEngine(2), [], [
        _copy_row(src.data_ptr(), src.nbytes, fp8_name, out.data_ptr(), out.nbytes, wide_name, [768], [1], [1])
    ])  # fmt: skip
    assert torch.equal(out.view(bits), ref.view(bits))  # NaN payloads included
    # Strided (a transposed view) takes the same path bit for bit.
    out_t = torch.empty(32, 24, dtype=wide)
    _execute(native.CopyEngine(1), [], [
        _copy_row(src.data_ptr(), src.nbytes, fp8_name, out_t.data_ptr(), out_t.nbytes, wide_name, [24, 32], [32, 1],
                  [1, 24])
    ])  # fmt: skip
    assert torch.equal(out_t.t().contiguous().view(bits), ref.view(24, 32).view(bits))


def test_fp8_to_float_matches_torch_for_every_byte() -> None:
    for fp8, name in FP8:
        ref = torch.arange(256, dtype=torch.uint8).view(fp8).float()
        got = torch.tensor([ext.fp8_to_float(b, name) for b in range(256)], dtype=torch.float32)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize(
    ("src", "dst"),
    [("F32", "F8_E4M3"), ("BF16", "F8_E5M2"), ("F8_E4M3", "F8_E5M2"), ("F8_E8M0", "F32"), ("I32", "F32"),
     ("C64", "F64"), ("F8_E4M3FNUZ", "BF16"), ("U8", "F8_E4M3")],
)  # fmt: skip
def test_casts_the_engine_cannot_do_exactly_are_named_errors(src: str, dst: str) -> None:
    buf = np.zeros(64, dtype=np.uint8)
    out = np.full(64, 7, dtype=np.uint8)
    row = _copy_row(buf.ctypes.data, 64, src, out.ctypes.data, 64, dst, [2], [1], [1])
    ok = _copy_row(buf.ctypes.data, 64, "U8", out.ctypes.data, 64, "U8", [2], [1], [1])
    with pytest.raises(CopyOpError, match=f"copy op 1: no conversion from {src} to {dst}"):
        _execute(native.CopyEngine(1), [], [ok, row])
    assert (out == 7).all()  # a bad batch writes nothing


def test_same_dtype_copies_as_bytes_for_dtypes_without_casts() -> None:
    src = np.arange(64, dtype=np.uint8)
    for name in ("F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64", "BOOL", "I16", "U64"):
        out = np.zeros(64, dtype=np.uint8)
        n = 64 * 8 // _bits(name)
        _execute(native.CopyEngine(2), [], [
            _copy_row(src.ctypes.data, 64, name, out.ctypes.data, 64, name, [n], [1], [1])
        ])  # fmt: skip
        assert (out == src).all(), name


# ---------------------------------------------------------------- fork safety


def _fork_and_copy_in_child(sf: object, eng: object, begin: int, end: int, expect: bytes) -> None:
    """Forks; the child copies through the parent's engine and exits 0 if the
    bytes are right. The parent kills a child that hangs, so this never hangs."""
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery, just the copy and an exit code
        code = 1
        try:
            out = np.zeros(end - begin, dtype=np.uint8)
            for _ in range(3):
                _execute(eng, [sf], [_copy_row(begin, end - begin, "U8", out.ctypes.data, out.nbytes, "U8",
                                               [end - begin], [1], [1], file=0)])  # fmt: skip
            code = 0 if out.tobytes() == expect else 2
        finally:
            os._exit(code)
    wait_for_child(pid, 20, "the child deadlocked copying through an engine created before fork()")


def test_engine_created_before_fork_works_in_the_child(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    n = 12 << 20  # several pieces, so every worker takes part
    path.write_bytes(_file_bytes([("t", "U8", [n], n)], fill=5))
    sf = native.SafetensorsFile(str(path), "mmap")
    _, _, _, begin, end = sf.tensors[0]
    expect = path.read_bytes()[sf.data_start + begin : sf.data_start + end]
    eng = native.CopyEngine(4)
    out = np.zeros(n, dtype=np.uint8)
    _execute(eng, [sf], [_copy_row(begin, n, "U8", out.ctypes.data, n, "U8", [n], [1], [1], file=0)])
    _fork_and_copy_in_child(sf, eng, begin, end, expect)
    # The parent's workers are untouched by the child's restart.
    out[:] = 0
    _execute(eng, [sf], [_copy_row(begin, n, "U8", out.ctypes.data, n, "U8", [n], [1], [1], file=0)])
    assert out.tobytes() == expect
    # A grandchild of a child that already restarted its pool restarts again.
    pid = os.fork()
    if pid == 0:
        try:
            _fork_and_copy_in_child(sf, eng, begin, end, expect)
            os._exit(0)
        except BaseException:
            os._exit(3)
    wait_for_child(pid, 40, "nested fork hung")


def test_engine_destroyed_in_a_child_that_never_used_it() -> None:
    eng = native.CopyEngine(3)
    pid = os.fork()
    if pid == 0:
        del eng  # joining the parent's threads here would hang forever
        os._exit(0)
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("destroying a pre-fork engine in the child hung")
        time.sleep(0.05)


def test_checkpoint_reads_sub_byte_tensors_as_bytes_and_names_the_cast(tmp_path: Path) -> None:
    from streamload.io.checkpoint import Checkpoint

    path = tmp_path / "f4.safetensors"
    data = _file_bytes([("w", "F4", [6, 8], 24), ("e", "F8_E8M0", [4], 4), ("c", "C64", [2], 16)])
    path.write_bytes(data)
    ckpt = Checkpoint(path)
    assert ckpt.info("w").dtype == "F4"
    assert ckpt.read_bytes("w").numpy().tobytes() == data[-44:-20]
    assert torch.equal(
        ckpt.read("e").view(torch.uint8), torch.frombuffer(bytearray(data[-20:-16]), dtype=torch.uint8)
    )
    assert ckpt.read("c").dtype == torch.complex64
    with pytest.raises(DTypeMismatchError, match="F4 has no torch element type"):
        ckpt.read("w")
    with pytest.raises(DTypeMismatchError, match="cannot read F8_E8M0 into torch.float32"):
        ckpt.read("e", dtype=torch.float32)


def test_two_threads_of_a_forked_child_run_one_pre_fork_engine(tmp_path: Path) -> None:
    """Two threads of a child call run() on the parent's engine at once: the
    pool was reset by the fork handler, so its workers start once (no race on
    them) and both copies are right."""
    import threading

    path = tmp_path / "f.safetensors"
    n = 12 << 20  # several pieces per copy, so the workers take part
    path.write_bytes(_file_bytes([("t", "U8", [n], n)], fill=7))
    sf = native.SafetensorsFile(str(path), "mmap")
    _, _, _, begin, end = sf.tensors[0]
    expect = path.read_bytes()[sf.data_start + begin : sf.data_start + end]
    eng = native.CopyEngine(4)
    _execute(eng, [sf], [_copy_row(begin, 16, "U8", np.zeros(16, np.uint8).ctypes.data, 16, "U8", [16], [1], [1],
                                   file=0)])  # fmt: skip
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            outs = [np.zeros(n, dtype=np.uint8) for _ in range(2)]
            start = threading.Barrier(2)

            def copy(out: np.ndarray) -> None:
                start.wait()
                for _ in range(5):
                    _execute(eng, [sf], [_copy_row(begin, n, "U8", out.ctypes.data, n, "U8", [n], [1], [1],
                                                   file=0)])  # fmt: skip

            threads = [threading.Thread(target=copy, args=(o,)) for o in outs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            code = 0 if all(o.tobytes() == expect for o in outs) else 2
        finally:
            os._exit(code)
    wait_for_child(pid, 30, "two threads of a forked child hung on one engine")
