"""The cold-read path of the native engine (explicit, large, aligned preads,
O_DIRECT where the file system allows it) equals safetensors bit for bit;
residency, eviction and the bandwidth probe do what they say."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

try:
    from streamload.io import _native as native
except ImportError:
    from streamload import _native as native  # type: ignore[no-redef]

import streamload.errors as errors
from streamload.io import cold

ext: Any = getattr(native, "_ext", native)
ALIGN = int(ext.DIRECT_ALIGN)


def _tensors(seed: int, sizes: list[int]) -> dict[str, torch.Tensor]:
    """bf16/fp32/int8 tensors of odd sizes: offsets land anywhere."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    dtypes = [torch.bfloat16, torch.float32, torch.int8, torch.float16]
    for i, n in enumerate(sizes):
        dt = dtypes[i % len(dtypes)]
        t = (
            torch.randn(n, generator=gen).to(dt)
            if dt.is_floating_point
            else torch.randint(-128, 127, (n,), generator=gen, dtype=torch.int8)
        )
        out[f"t{i:03d}"] = t
    return out


def _layout(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (absolute file offset, bytes), from the header."""
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
    header.pop("__metadata__", None)
    start = 8 + hlen
    return {
        k: (start + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
        for k, v in header.items()
    }


def _write_aligned(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A valid safetensors file whose data section and tensors start on DIRECT_ALIGN."""
    header: dict[str, Any] = {}
    off = 0
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int8: "I8", torch.float16: "F16"}
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        assert n % ALIGN == 0
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (ALIGN - 8 - len(raw))  # safetensors pads headers with spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 buffer whose first byte is DIRECT_ALIGN-aligned."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def _read(reader: Any, path: Path, rows: list[tuple[int, int, torch.Tensor]]) -> dict[str, Any]:
    """rows: (file offset, bytes, destination) sorted by offset."""
    arr = torch.tensor(
        [[off, n, dst.data_ptr(), dst.numel() * dst.element_size()] for off, n, dst in rows],
        dtype=torch.int64,
    ).reshape(-1, int(ext.RANGE_FIELDS))
    return reader.read(str(path), arr.data_ptr(), arr.numel() * 8)


def _check_all(reader: Any, path: Path, aligned_dst: bool = False) -> dict[str, Any]:
    """Reads every tensor of the file in one call; compares with safetensors."""
    layout = sorted(_layout(path).items(), key=lambda kv: kv[1][0])
    dsts = {
        k: (_aligned_empty(n) if aligned_dst else torch.empty(n, dtype=torch.uint8)) for k, (_, n) in layout
    }
    for d in dsts.values():
        d.fill_(0xA5)
    stats = _read(reader, path, [(off, n, dsts[k]) for k, (off, n) in layout])
    stats["resident"] = _resident(path)  # before safetensors maps the file
    with safe_open(str(path), "pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            ref = f.get_tensor(k)
            assert torch.equal(dsts[k], ref.contiguous().view(torch.uint8).reshape(-1)), k
    return stats


@pytest.fixture
def unaligned(tmp_path: Path) -> Path:
    p = tmp_path / "unaligned.safetensors"
    save_file(_tensors(0, [1, 7, 3000, 4097, 70_001, 1 << 18, 5, 123_457, 3]), str(p))
    return p


@pytest.mark.parametrize("direct", ["auto", "off"])
@pytest.mark.parametrize("block", [ALIGN, 3 * ALIGN, 64 << 10, 8 << 20])
def test_unaligned_offsets_bit_exact(unaligned: Path, direct: str, block: int) -> None:
    reader = ext.ColdReader(threads=3, block_bytes=block, direct=direct)
    stats = _check_all(reader, unaligned)
    assert stats["bytes_requested"] == sum(n for _, n in _layout(unaligned).values())
    assert stats["bytes_read"] >= stats["bytes_requested"]
    if direct == "off":
        assert stats["direct_windows"] == 0
    if block == 8 << 20:
        assert stats["windows"] == 1  # the whole file is smaller than one read


def test_direct_used_where_the_file_system_allows(unaligned: Path) -> None:
    stats = _check_all(ext.ColdReader(threads=2, block_bytes=64 << 10, direct="auto"), unaligned)
    if not stats["direct_refused"]:
        assert stats["direct_windows"] == stats["windows"] > 1


@pytest.mark.parametrize("direct", ["auto", "off"])
@pytest.mark.parametrize("aligned_dst", [True, False])
def test_aligned_offsets_bit_exact(tmp_path: Path, direct: str, aligned_dst: bool) -> None:
    p = tmp_path / "aligned.safetensors"
    _write_aligned(p, _tensors(1, [ALIGN, 6 * ALIGN // 4, 50 * ALIGN, 2 * ALIGN // 2]))
    assert all(off % ALIGN == 0 for off, _ in _layout(p).values())
    # Windows inside one tensor go straight to an aligned destination (no bounce).
    _check_all(ext.ColdReader(threads=2, block_bytes=4 * ALIGN, direct=direct), p, aligned_dst)


def test_small_files_and_empty_reads(tmp_path: Path) -> None:
    p = tmp_path / "tiny.safetensors"
    save_file({"a": torch.tensor([1.5], dtype=torch.bfloat16), "b": torch.zeros(0)}, str(p))
    stats = _check_all(ext.ColdReader(), p)
    assert stats["windows"] == 1
    assert ext.ColdReader().read(str(p), 0, 0)["windows"] == 0


def test_subranges_and_gaps(unaligned: Path) -> None:
    """Slices of tensors (row ranges), every other one: gaps share reads."""
    whole = unaligned.read_bytes()
    layout = sorted(_layout(unaligned).values())
    rows = []
    for i, (off, n) in enumerate(layout):
        if i % 2 or n < 10:
            continue
        a, b = off + n // 3 + 1, off + n - n // 5
        rows.append((a, b - a, torch.empty(b - a, dtype=torch.uint8)))
    for block in (ALIGN, 1 << 20):
        for direct in ("auto", "off"):
            for _, _, d in rows:
                d.zero_()
            _read(ext.ColdReader(threads=4, block_bytes=block, direct=direct), unaligned, rows)
            for off, n, d in rows:
                assert bytes(d.numpy()) == whole[off : off + n]


@pytest.mark.parametrize("gap", [0, 100])
@pytest.mark.parametrize("piece", [1000, 4096, 64 << 10, 300_001])
def test_buffered_window_of_near_ranges(tmp_path: Path, piece: int, gap: int) -> None:
    """Buffered: one window over many ranges (adjacent, or 100 bytes apart), each into its
    own destination with guard bytes around it. Short ranges share one read into a bounce
    buffer; ranges of 64 KiB or more on average are read one by one straight into their
    destinations. The same bytes, nothing written outside a range, and the bytes counted
    are the window's span from the first range to the last (the gaps too, as the kernel
    was asked for them)."""
    p = tmp_path / "near.bin"
    n = 6
    data = torch.randint(0, 256, (n * (piece + gap) + 11,), generator=torch.Generator().manual_seed(piece))
    p.write_bytes(bytes(data.to(torch.uint8).numpy()))
    whole = p.read_bytes()
    guard = 64
    rows = []
    for i in range(n):
        room = torch.full((piece + 2 * guard,), 0xA5, dtype=torch.uint8)
        rows.append((5 + i * (piece + gap), piece, room))
    arr = torch.tensor(
        [[off, m, room.data_ptr() + guard, m] for off, m, room in rows], dtype=torch.int64
    ).reshape(-1, int(ext.RANGE_FIELDS))
    stats = ext.ColdReader(block_bytes=64 << 20, direct="off").read(str(p), arr.data_ptr(), arr.numel() * 8)
    assert stats["windows"] == 1 and stats["bytes_read"] == n * piece + (n - 1) * gap
    for off, m, room in rows:
        assert bytes(room[guard : guard + m].numpy()) == whole[off : off + m]
        assert (room[:guard] == 0xA5).all() and (room[guard + m :] == 0xA5).all()


def test_direct_refused_falls_back(unaligned: Path) -> None:
    """A file system that refuses O_DIRECT (EINVAL on read, ``refuse_direct_for_test``):
    buffered, same bytes; ``direct="on"`` raises instead."""
    refusing = ext.ColdReader(threads=3, block_bytes=64 << 10, refuse_direct_for_test=True)
    stats = _check_all(refusing, unaligned)
    assert stats["direct_refused"] and stats["direct_windows"] == 0
    with pytest.raises(errors.CheckpointFileError, match="O_DIRECT"):
        _check_all(ext.ColdReader(direct="on", refuse_direct_for_test=True), unaligned)
    probe = ext.ColdReader(threads=2, block_bytes=64 << 10, refuse_direct_for_test=True).probe(
        [str(unaligned)]
    )
    assert probe["direct_refused"] and probe["bytes_read"] == unaligned.stat().st_size


def test_the_native_reader_reads_no_environment(unaligned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller decides (``direct``): STREAMLOAD_DIRECT_IO is the Python loader's to read,
    once (``streamload.options``), and changes nothing here."""
    monkeypatch.setenv("STREAMLOAD_DIRECT_IO", "0")
    stats = _check_all(ext.ColdReader(block_bytes=64 << 10), unaligned)
    assert stats["direct_windows"] > 0 or stats["direct_refused"], stats
    monkeypatch.setenv("STREAMLOAD_DIRECT_IO", "1")
    stats = _check_all(ext.ColdReader(block_bytes=64 << 10, direct="off"), unaligned)
    assert stats["direct_windows"] == 0 and not stats["direct_refused"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_tmpfs(tmp_path: Path) -> None:
    """tmpfs: refuses O_DIRECT on older kernels, accepts it on newer; same bytes either way."""
    d = Path("/dev/shm") / f"streamload-cold-{os.getpid()}"
    d.mkdir(exist_ok=True)
    try:
        p = d / "x.safetensors"
        save_file(_tensors(2, [17, 40_000, 3, 9_999]), str(p))
        for direct in ("auto", "off"):
            _check_all(ext.ColdReader(threads=2, block_bytes=ALIGN * 2, direct=direct), p)
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def test_bounds_checked_before_any_write(unaligned: Path) -> None:
    size = unaligned.stat().st_size
    reader = ext.ColdReader()
    dst = torch.zeros(64, dtype=torch.uint8)
    other = torch.zeros(64, dtype=torch.uint8)
    bad = {
        "smaller than the read": [(0, 64, other), (100, 65, dst)],
        "past the end": [(0, 64, other), (size - 10, 11, dst)],
        "sorted": [(100, 8, other), (0, 8, dst)],
        "overlap": [(0, 16, other), (8, 16, dst)],
    }
    for why, rows in bad.items():
        with pytest.raises(errors.CheckpointFileError, match=why):
            _read(reader, unaligned, rows)
        assert int(other.count_nonzero()) == 0 and int(dst.count_nonzero()) == 0, why
    with pytest.raises(ValueError, match="whole number"):
        reader.read(str(unaligned), dst.data_ptr(), 24)
    neg = torch.tensor([[-1, 8, dst.data_ptr(), 64]])
    with pytest.raises(ValueError, match="negative"):
        reader.read(str(unaligned), neg.data_ptr(), 32)
    with pytest.raises(errors.CheckpointFileError, match="cannot open"):
        reader.read(str(unaligned) + ".missing", 0, 0)
    with pytest.raises(ValueError, match="direct"):
        ext.ColdReader(direct="sometimes")


def _resident(path: Path) -> float:
    got, total = ext.residency(str(path))
    return got / max(total, 1)


def test_residency_evict_and_drop_behind(tmp_path: Path) -> None:
    p = tmp_path / "big.safetensors"
    save_file(_tensors(3, [1 << 20, 1 << 20, 333_333]), str(p))
    p.read_bytes()
    assert _resident(p) > 0.99
    ext.evict(str(p))  # writes the fresh file back first, so the pages can go
    if _resident(p) > 0.01:
        pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED")
    assert ext.residency(str(p), 0, 10)[1] == 1
    assert _check_all(ext.ColdReader(direct="off"), p)["resident"] > 0.9  # buffered reads fill the cache ...
    ext.evict(str(p))
    stats = _check_all(ext.ColdReader(direct="off", drop_behind=True, block_bytes=1 << 20), p)
    assert stats["resident"] < 0.01  # ... unless dropped behind the reader
    ext.evict(str(p))
    stats = _check_all(ext.ColdReader(direct="auto"), p)
    if stats["direct_windows"]:
        assert stats["resident"] < 0.01  # O_DIRECT bypasses it


def _settled(p: Path) -> tuple[int, int]:
    """The exact (resident, pages) once the kernel's readahead has stopped adding pages."""
    last = ext.residency(str(p))
    for _ in range(50):
        time.sleep(0.02)
        now = ext.residency(str(p))
        if now == last:
            return now
        last = now
    return last


def test_sampled_residency_tracks_the_exact_count(tmp_path: Path) -> None:
    """Sampled mincore (what ``read_mode="auto"`` decides on) probes about the pages asked for,
    first and last windows included, and estimates the cached fraction of a partly read file."""
    p = tmp_path / "big.safetensors"
    save_file(_tensors(4, [3 << 20]), str(p))  # 1537 pages
    ext.evict(str(p))
    if _resident(p) > 0.01:
        pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED")
    size = p.stat().st_size
    with open(p, "rb") as f:
        f.read(size // 3)  # the first third (and the kernel's readahead past it)
    exact, pages = _settled(p)
    got, probed = ext.residency(str(p), 0, 0, 256)
    assert pages == (size + 4095) // 4096 and 240 <= probed <= 256
    assert abs(got / probed - exact / pages) < 0.05
    assert cold.residency([p], 256) == pytest.approx(exact / pages, abs=0.05)
    assert ext.residency(str(p), 0, 0, 10**6) == (exact, pages)  # more than the file: every page
    # Two 16-page windows would overlap on 21 pages: every page, each counted once.
    assert ext.residency(str(p), 0, 21 * 4096, 20) == ext.residency(str(p), 0, 21 * 4096)
    ext.evict(str(p))
    with open(p, "rb") as f:
        f.seek(size - 4096)
        f.read()  # only the last page
    assert ext.residency(str(p), 0, 0, 256)[0] >= 1  # the last window reaches the last page
    ext.evict(str(p))
    assert cold.residency([p], 256) == 0.0
    assert cold.choose_read_mode("auto", [p]) == "cold"


def test_probe_reads_every_byte_once(tmp_path: Path) -> None:
    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}.safetensors"
        save_file(_tensors(10 + i, [200_000 + i, 77]), str(p))
        paths.append(str(p))
    for direct in ("auto", "off"):
        stats = ext.ColdReader(threads=2, block_bytes=64 << 10, direct=direct).probe(paths)
        total = sum(os.path.getsize(p) for p in paths)
        assert stats["bytes_requested"] == total
        assert stats["bytes_read"] == total
        assert stats["seconds"] > 0
        if direct == "off":
            assert stats["direct_windows"] == 0


def test_aligned_layout_up_to_the_end_of_the_file(unaligned: Path) -> None:
    """Ranges widened to aligned bounds (the last one ending at the end of an
    unaligned file) into aligned destinations: read in place."""
    size = unaligned.stat().st_size
    assert size % ALIGN
    whole = unaligned.read_bytes()
    cut = (size // 2) // ALIGN * ALIGN
    spans = [(0, cut), (cut, size - cut)]
    rows = [(a, n, _aligned_empty(-(-n // ALIGN) * ALIGN)) for a, n in spans]
    for direct in ("auto", "off"):
        for _, _, d in rows:
            d.zero_()
        _read(ext.ColdReader(threads=2, block_bytes=3 * ALIGN, direct=direct), unaligned, rows)
        for a, n, d in rows:
            assert bytes(d[:n].numpy()) == whole[a : a + n]


def test_prefetch_fills_the_page_cache(tmp_path: Path) -> None:
    p = tmp_path / "pre.safetensors"
    save_file(_tensors(5, [1 << 20, 1 << 20, 1 << 20]), str(p))
    ext.evict(str(p))
    if _resident(p) > 0.01:
        pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED")
    size = p.stat().st_size
    a, n = size // 4 + 3, size // 2
    arr = torch.tensor([[a, n], [a + 10, 7]], dtype=torch.int64)  # overlapping ranges merge
    stats = ext.ColdReader(threads=3, block_bytes=64 << 10).prefetch(str(p), arr.data_ptr(), arr.numel() * 8)
    assert stats["bytes_read"] == n
    got, total = ext.residency(str(p), a, n)
    assert got >= total - 2  # the ends may share a page with what was not asked for
    assert ext.residency(str(p), 0, a - 8192)[0] == 0  # readahead only runs forward
    bad = torch.tensor([[size - 1, 2]], dtype=torch.int64)
    with pytest.raises(errors.CheckpointFileError, match="past the end"):
        ext.ColdReader().prefetch(str(p), bad.data_ptr(), 16)


def test_buffered_reads_ask_for_their_windows_only(tmp_path: Path) -> None:
    """A buffered reader reading every other MiB of a cold file (one rank's slices of each
    tensor) brings those MiBs into the page cache and not the ones between (the next
    rank's bytes), which plain preads with the kernel's readahead read into as well
    (61-62% of such a file here); the bytes are right, over several calls on the
    descriptors the reader keeps open."""
    p = tmp_path / "big.bin"
    data = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    p.write_bytes(data.numpy().tobytes())
    ext.evict(str(p))
    assert ext.residency(str(p))[0] == 0
    reader = ext.ColdReader(threads=1, block_bytes=4 << 20, direct="off")
    mib = 1 << 20
    rows = [(off, mib, torch.empty(mib, dtype=torch.uint8)) for off in range(0, 32 * mib, 2 * mib)]
    for part in (rows[:8], rows[8:]):  # two calls, as two chunks of one load
        _read(reader, p, part)
    for off, n, dst in rows:
        assert torch.equal(dst, data[off : off + n])
    resident, pages = ext.residency(str(p))
    assert 0.49 <= resident / pages <= 0.53, resident / pages


def _guarded_read(
    reader: Any, path: Path, spans: list[tuple[int, int]], data: torch.Tensor
) -> dict[str, Any]:
    """Reads ``spans`` into destinations with 64 guard bytes after each; checks the bytes
    and that no guard byte was written."""
    dsts = [torch.full((n + 64,), 0x5A, dtype=torch.uint8) for _, n in spans]
    stats = _read(reader, path, [(off, n, d) for (off, n), d in zip(spans, dsts, strict=True)])
    for (off, n), d in zip(spans, dsts, strict=True):
        assert torch.equal(d[:n], data[off : off + n])
        assert bool((d[n:] == 0x5A).all()), "a read wrote past its destination"
    return stats


def test_buffered_reads_long_and_short_ranges_exactly(tmp_path: Path) -> None:
    """Buffered, ranges of 64 KiB or more (one pread each, straight into place) and shorter
    ones (one read into a bounce buffer, copied out) give the right bytes and write nothing
    past their destinations."""
    p = tmp_path / "ranges.bin"
    mib = 1 << 20
    data = torch.randint(0, 256, (12 * mib,), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    p.write_bytes(data.numpy().tobytes())
    reader = ext.ColdReader(threads=1, block_bytes=4 << 20, direct="off")
    cuts = [0, 1, 4097, 3 * mib + 5, 5 * mib, 8 * mib]  # whole tensors meeting end to end
    whole = list(zip(cuts, [b - a for a, b in zip(cuts, cuts[1:], strict=False)], strict=False))
    short = [(9 * mib + 20_000 * i, 20_000) for i in range(100)]  # ~1.9 MiB of 20 KB ranges
    for spans in (whole, short):
        ext.evict(str(p))
        stats = _guarded_read(reader, p, spans, data)
        assert stats["direct_windows"] == 0 and stats["bytes_read"] >= sum(n for _, n in spans), stats


def test_use_threads_swaps_a_plain_engine_only(tmp_path: Path) -> None:
    """The owners-mode reader takes its node share of copy threads over the files it holds open:
    a mapped checkpoint gets a new engine with that many threads and reads the same bytes; a cold
    one keeps its own engine (its reads and buffers are set up for it)."""
    from streamload.io.checkpoint import Checkpoint

    p = tmp_path / "model.safetensors"
    tensors = _tensors(5, [4096, 333])
    save_file(tensors, str(p))
    mapped = Checkpoint(tmp_path, mode="mmap", threads=2)
    assert mapped.use_threads(1) and mapped.engine.threads == 1
    name = next(iter(tensors))
    assert torch.equal(mapped.read(name), tensors[name])
    cold_ckpt = Checkpoint(tmp_path, mode="cold")
    engine = cold_ckpt.engine
    assert not cold_ckpt.use_threads(1) and cold_ckpt.engine is engine
    assert torch.equal(cold_ckpt.read(name), tensors[name])
