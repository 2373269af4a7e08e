"""The copy engine faults in each piece's destination pages in one madvise before copying it:
not a byte differs, the whole span of a dense piece is faulted in (seen with mincore, not
timed), and sparse destinations are left to fault as they are written."""

from __future__ import annotations

import mmap
from collections.abc import Callable

import pytest
import torch
from pages import resident

from streamload.io import _native
from streamload.io.copy_ops import OpBatch
from streamload.transport.prefault import (
    MADV_NOHUGEPAGE,
    MADV_POPULATE_WRITE,
    PAGE,
    advise,
    page_ranges,
    populate_on_copy,
)


def _fresh(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Private anonymous memory no one has touched yet (its own mapping, as a large shard's
    allocation is: no pages), in 4 KiB pages even where transparent huge pages are "always"."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    advise(page_ranges([t]), MADV_NOHUGEPAGE)
    return m, t


def _can_populate() -> bool:
    """Whether this kernel has MADV_POPULATE_WRITE (Linux >= 5.14)."""
    probe, view = _fresh(PAGE)
    try:
        return advise(page_ranges([view]), MADV_POPULATE_WRITE)
    finally:
        del view
        probe.close()


def _copy(engine: object, src: torch.Tensor, dst: torch.Tensor, rows: int, cols: int, at: int) -> None:
    """Copies ``src`` (rows x cols bytes) into ``dst`` as a [rows, cols] box at column ``at`` of
    rows ``dst.numel() // rows`` wide."""
    width = dst.numel() // rows
    batch = OpBatch()
    batch.add(
        file=-1, src=src.data_ptr(), src_nbytes=src.numel(), src_dtype="U8", dst=dst, dst_dtype="U8",
        shape=[rows, cols], src_strides=[cols, 1], dst_strides=[width, 1], dst_offset=at,
    )  # fmt: skip
    batch.execute(engine, [])


def _off_then_on(
    engine: object, nbytes: int, write: Callable[[torch.Tensor], None], check: Callable[[torch.Tensor], None]
) -> dict[bool, float]:
    """Runs ``write`` into fresh memory with populate off, then on; returns the residency after
    each (measured before ``check`` reads anything the write skipped)."""
    seen = {}
    for on in (False, True):
        engine.populate = on  # type: ignore[attr-defined]
        keep, dst = _fresh(nbytes)
        write(dst)
        seen[on] = resident(dst)
        check(dst)
        del dst
        keep.close()
    return seen


def _assert_span_populated(seen: dict[bool, float]) -> None:
    """Off, the row's 4th page was never touched; on, the madvise faulted it in with the rest."""
    assert seen[False] == pytest.approx(0.75, abs=0.02)
    if not _can_populate():
        pytest.skip("MADV_POPULATE_WRITE is not supported by this kernel (Linux >= 5.14)")
    assert seen[True] > 0.99


@pytest.mark.parametrize("threads", [1, 2])
def test_populated_copy_is_exact_and_faults_its_span_in_at_once(threads: int) -> None:
    """Rows of 4 pages, the box writing the first 3 of each: dense enough to populate, so the
    4th page of every row is faulted in too (what shows the madvise ran: a copy alone never
    touches it), and every byte is the source's or still zero."""
    engine = _native.CopyEngine(threads)
    assert engine.populate  # the default
    rows, width, cols = 256, 4 * PAGE, 3 * PAGE
    src = torch.randint(0, 256, (rows * cols,), dtype=torch.uint8)

    def check(dst: torch.Tensor) -> None:
        grid = dst.view(rows, width)
        assert torch.equal(grid[:, :cols].reshape(-1), src)
        assert not bool(grid[:, cols:].any())

    _assert_span_populated(
        _off_then_on(engine, rows * width, lambda dst: _copy(engine, src, dst, rows, cols, 0), check)
    )


def test_sparse_destination_is_left_to_fault_and_neighbours_keep_their_bytes() -> None:
    """A column slice (a quarter of each row) spans 4x the bytes it writes: not populated, and
    the columns between keep what they held."""
    engine = _native.CopyEngine(1)
    rows, width = 512, 16 << 10
    keep, dst = _fresh(rows * width)
    dst.view(rows, width)[:, : width // 2].fill_(7)  # half the pages now hold data
    src = torch.randint(0, 256, (rows * width // 4,), dtype=torch.uint8)
    _copy(engine, src, dst, rows, width // 4, width // 2)
    share = resident(dst)
    grid = dst.view(rows, width)
    assert torch.equal(grid[:, width // 2 : 3 * width // 4].reshape(-1), src)
    assert bool((grid[:, : width // 2] == 7).all()) and bool((grid[:, 3 * width // 4 :] == 0).all())
    assert share == pytest.approx(0.75, abs=0.02)  # the last quarter was never faulted in
    del grid, dst
    keep.close()


def test_prefault_keyword_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefault=False`` (or STREAMLOAD_PREFAULT=0 when the keyword is not given) turns it off,
    on a native engine and on one wrapping it."""

    class Wrapper:
        def __init__(self, engine: object) -> None:
            self.engine = engine

    monkeypatch.delenv("STREAMLOAD_PREFAULT", raising=False)
    native = _native.CopyEngine(1)
    populate_on_copy(native, False)
    assert not native.populate
    populate_on_copy(Wrapper(native), None)
    assert native.populate
    monkeypatch.setenv("STREAMLOAD_PREFAULT", "0")
    populate_on_copy(native, None)
    assert not native.populate
    populate_on_copy(native, True)
    assert native.populate
    populate_on_copy(object(), False)  # an engine without the switch (a remote one's own): nothing


def test_dequantized_pieces_are_populated_too() -> None:
    """FP8 block-scaled rows dequantized into 3 of every 4 pages of a row: the 4th is faulted in
    with populate on, left alone with it off; the values equal transformers' either way."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    rows, cols, width = 64, 6 * PAGE // 4, 2 * PAGE  # bf16: a row of 4 pages, 3 of them written
    w = (torch.randn(rows, cols) * 8).to(torch.float8_e4m3fn)
    s = torch.rand(1, cols // 128) + 0.5  # one block row of scales
    want = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.bfloat16)
    engine = _native.CopyEngine(2)

    def write(raw: torch.Tensor) -> None:
        batch = OpBatch()
        batch.add_dequant(
            kind="fp8_block", weight=(-1, w.data_ptr(), w.numel(), "F8_E4M3"),
            scale=(-1, s.data_ptr(), s.numel() * 4, "F32"), dst=raw.view(torch.bfloat16), dst_dtype="BF16",
            dims=(1, rows, cols), block=(128, 128), box=((0, 1), (0, rows), (0, cols)),
            dst_offset=0, dst_strides=(rows * width, width, 1),
        )  # fmt: skip
        batch.execute(engine, [])

    def check(raw: torch.Tensor) -> None:
        assert torch.equal(raw.view(torch.bfloat16).view(rows, width)[:, :cols], want)

    _assert_span_populated(_off_then_on(engine, rows * width * 2, write, check))


def test_unaligned_destination_populates_only_its_own_whole_pages() -> None:
    """A destination that starts and ends inside pages: the bytes around it keep theirs (the
    partial pages at its ends are the copy's to fault), and it is filled exactly."""
    engine = _native.CopyEngine(1)
    keep, raw = _fresh(64 * PAGE)
    raw[:100].fill_(5)
    raw[-100:].fill_(9)
    dst = raw[100:-100]
    src = torch.randint(0, 256, (dst.numel(),), dtype=torch.uint8)
    _copy(engine, src, dst, 1, dst.numel(), 0)
    assert torch.equal(dst, src)
    assert bool((raw[:100] == 5).all()) and bool((raw[-100:] == 9).all())
    del dst, raw
    keep.close()
