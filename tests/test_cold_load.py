"""The cold path at the Python level: ``read_mode="cold"`` (explicit, large,
aligned reads) is bit-exact with transformers at 2-3 gloo ranks, ``"auto"``
picks it when the files are not in the page cache, and ``drop_cache`` leaves
them out of it."""

from __future__ import annotations

from pathlib import Path

import cases_cold
import pytest
import torch
from rank_group import RankGroup
from safetensors import safe_open

from streamload import Checkpoint
from streamload.io import cold
from streamload.io.copy_ops import bit_view
from streamload.tools.synthetic import make_checkpoint

WORLD = 3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cold")
    common = dict(
        layers=2,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return {
        "tied": str(
            make_checkpoint(root / "tied", "qwen2", tie=True, seed=1, max_shard_size="8KB", **common)
        ),
        "one_file": str(make_checkpoint(root / "one", "qwen2", tie=False, seed=2, **common)),
    }


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


def _paths(ckpt: str) -> list[str]:
    return sorted(str(p) for p in Path(ckpt).glob("*.safetensors"))


def _check_all(c: Checkpoint, ckpt: str) -> None:
    for path in _paths(ckpt):
        with safe_open(path, "pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                ref = f.get_tensor(k)
                assert torch.equal(bit_view(c.read(k)), bit_view(ref)), k
                if ref.dtype == torch.bfloat16:
                    assert torch.equal(c.read(k, dtype=torch.float32), ref.float()), k
                if ref.dim() == 2 and ref.shape[0] > 2:
                    part = c.read_region(k, [(1, ref.shape[0] - 1), (0, ref.shape[1])])
                    assert torch.equal(bit_view(part), bit_view(ref[1:-1])), k


@pytest.mark.parametrize("name", ["tied", "one_file"])
def test_checkpoint_cold_reads_bit_exact(ckpts: dict[str, str], name: str, monkeypatch) -> None:
    """Buffered (the default), O_DIRECT refused by the file system, and O_DIRECT: the same bytes."""
    monkeypatch.delenv("STREAMLOAD_DIRECT_IO", raising=False)
    c = Checkpoint(ckpts[name], mode="cold")
    _check_all(c, ckpts[name])
    assert c.engine.buffered and c.engine.stats.reads > 0 and c.engine.stats.direct_reads == 0
    with monkeypatch.context() as m:  # a file system refusing O_DIRECT: every reader made refuses
        real = cold._native.ColdReader
        m.setattr(cold._native, "ColdReader", lambda **kw: real(**kw, refuse_direct_for_test=True))
        c = Checkpoint(ckpts[name], mode="cold", direct_io=True)
        _check_all(c, ckpts[name])
    assert not c.engine.buffered
    assert c.engine.stats.direct_refused and c.engine.stats.direct_reads == 0
    c.engine.close()
    c = Checkpoint(ckpts[name], mode="cold", direct_io=True)
    _check_all(c, ckpts[name])
    if c.engine.stats.direct_refused:
        pytest.skip("this file system refuses O_DIRECT (its fallback was checked above)")
    assert not c.engine.buffered and c.engine.stats.direct_reads > 0


def test_auto_reads_explicitly_when_the_files_are_cold(ckpts: dict[str, str]) -> None:
    paths = _paths(ckpts["one_file"])
    cold.evict(paths)
    assert cold.residency(paths) < 0.01
    c = Checkpoint(ckpts["one_file"])
    assert c.read_mode == "cold" and isinstance(c.engine, cold.ColdEngine)
    # Mapped all the same (shards may be views, prefetched), unless nothing may stay cached.
    assert all(f.mapped for f in c.files)
    assert not any(f.mapped for f in Checkpoint(ckpts["one_file"], mode="cold", drop_cache=True).files)
    for p in paths:
        Path(p).read_bytes()
    assert cold.residency(paths) > 0.99
    c = Checkpoint(ckpts["one_file"])
    assert c.read_mode == "mmap" and all(f.mapped for f in c.files)
    with pytest.raises(ValueError, match="read_mode"):
        Checkpoint(ckpts["one_file"], mode="sometimes")


@pytest.mark.parametrize("direct_io", [None, False])
def test_drop_cache_leaves_the_files_out_of_the_page_cache(
    ckpts: dict[str, str], monkeypatch: pytest.MonkeyPatch, direct_io: bool | None
) -> None:
    """Buffered reads (the default) fill the page cache; drop_cache leaves nothing behind,
    read O_DIRECT (the default with drop_cache) or buffered (forced: dropped behind the reader)."""
    paths = _paths(ckpts["one_file"])
    monkeypatch.delenv("STREAMLOAD_DIRECT_IO", raising=False)
    for drop in (False, True):
        cold.evict(paths)
        c = Checkpoint(ckpts["one_file"], mode="cold", drop_cache=drop, direct_io=direct_io)
        assert c.engine.buffered is (direct_io is False or not drop)
        out = {t.name: c.read(t.name) for t in c.tensors}
        assert len(out) == len(c.tensors)
        resident = cold.residency(paths)
        assert (resident < 0.01) if drop else (resident > 0.5), (drop, resident)


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize(
    ("readers", "direct_io"), [("src", None), ("src", True), ("owners", None), ("node", None)]
)
def test_cold_load_matches_transformers(
    group: RankGroup, ckpts: dict[str, str], ws: int, readers: str, direct_io: bool | None
) -> None:
    """Cold loads bit-exact with transformers in every reader mode ("node": two simulated
    nodes, named by the ``node`` keyword), every reader reading buffered (the default; plain
    copies land in their destinations, casts go through the read buffers) or O_DIRECT
    (``direct_io=True``)."""
    refused = False
    for name in ("tied", "one_file"):
        for dtype in (None, torch.float32):
            res = group.run(
                cases_cold.case_cold_load,
                ckpt=ckpts[name],
                ws=ws,
                read_mode="cold",
                readers=readers,
                dtype=dtype,
                direct_io=direct_io,
                nodes=2 if readers == "node" else 0,
            )
            assert res[0]["read_mode"] == "cold"
            readers_ = [r for r in res if r and r["cold_reads"]]
            expect = {"src": 1, "owners": ws, "node": 2}[readers]
            assert len(readers_) == expect, res
            for r in readers_:
                refused |= r["direct_refused"]
                if direct_io:
                    assert not r["buffered"] and (r["direct_reads"] > 0 or r["direct_refused"]), r
                    assert r["in_place_bytes"] == 0, r
                else:
                    assert r["buffered"] and r["direct_reads"] == 0, r
                    if dtype is None:  # the checkpoint's dtype: plain copies land in place
                        assert r["in_place_bytes"] > 0, r
            if any(r["mapped"] for r in res if r):
                # Shards that are views of cold files were prefetched into the page cache.
                assert res[0]["resident"] > 0
    if refused:
        pytest.skip("this file system refuses O_DIRECT: the loads read buffered (bit-exact all the same)")


def test_auto_and_drop_cache_in_a_load(group: RankGroup, ckpts: dict[str, str]) -> None:
    ckpt = ckpts["tied"]
    res = group.run(cases_cold.case_cold_load, ckpt=ckpt, ws=2, read_mode="auto")
    assert res[0]["read_mode"] == "cold"  # evicted: auto read explicitly
    res = group.run(cases_cold.case_cold_load, ckpt=ckpt, ws=3, read_mode="cold")
    assert res[0]["resident"] > 0.5  # buffered reads leave the pages in the cache
    res = group.run(
        cases_cold.case_cold_load, ckpt=ckpt, ws=3, read_mode="cold", direct_io=False, drop_cache=True
    )
    assert res[0]["resident"] < 0.01  # even forced buffered: each window dropped behind the reader


@pytest.mark.parametrize("chunk", [64, 1000, 4096])
def test_chunked_reads_bit_exact(ckpts: dict[str, str], chunk: int) -> None:
    """Ops cut along their outer dims into many small chunks, read on the helper
    thread while the previous chunk is copied: the same bytes."""
    c = Checkpoint(ckpts["one_file"], mode="cold")
    first, c.engine = c.engine, cold.ColdEngine(c.engine.engine, c.files, block_bytes=4096, chunk_bytes=chunk)
    first.close()
    try:
        _check_all(c, ckpts["one_file"])
        assert c.engine.stats.reads > 10
    finally:
        c.engine.close()


def test_transposed_source_larger_than_a_chunk_is_cut_not_recursed() -> None:
    """A transposed source (outer dim stride 1) over a chunk: cut along the dim that spans
    the most bytes, every piece within a chunk, the elements all covered once."""
    import numpy as np

    from streamload.io import _native

    f = _native.OP_FIELDS
    row = np.zeros(f, dtype=np.int64)
    d = _native.MAX_DIMS
    shape, sst, dst = 10, 10 + d, 10 + 2 * d
    row[0], row[3], row[6], row[7] = 0, _native.DTYPE_CODES["BF16"], _native.DTYPE_CODES["BF16"], 2
    row[2] = 2 * 4 * (1 << 20)
    row[shape], row[shape + 1] = 4, 1 << 20
    row[sst], row[sst + 1] = 1, 4
    row[dst], row[dst + 1] = 1 << 20, 1

    class _Files:
        path, file_size, data_start = "/dev/null", 1 << 30, 0

    engine = cold.ColdEngine(None, [_Files()], chunk_bytes=1 << 20)
    pieces = engine._pieces(row)
    assert len(pieces) >= 8
    lo, hi, isz = engine._extents(np.stack(pieces))
    assert ((hi - lo + 1) * isz <= 1 << 20).all()
    assert sum(int(p[shape] * p[shape + 1]) for p in pieces) == 4 << 20


@pytest.mark.parametrize(
    ("env", "keyword", "drop", "direct"),
    [
        (None, None, False, False),
        (None, True, False, True),
        ("1", None, False, True),  # the variable applies where the keyword is not given
        ("0", True, False, True),  # a keyword passed explicitly wins over the variable
        ("1", False, False, False),
        (None, None, True, True),
        ("0", None, True, False),
    ],
)
def test_reads_buffered_unless_direct_is_forced_or_pages_are_dropped(
    ckpts: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    env: str | None,
    keyword: bool | None,
    drop: bool,
    direct: bool,
) -> None:
    """A new engine reads buffered (no O_DIRECT read), unless ``direct_io=True`` (or, not
    given, STREAMLOAD_DIRECT_IO=1) forces O_DIRECT or drop_cache needs it; the same bytes
    either way; and asking the engine for O_DIRECT then reads O_DIRECT, unless buffered
    reads were forced (``direct_io=False``, or STREAMLOAD_DIRECT_IO=0 where it is not given)."""
    if env is None:
        monkeypatch.delenv("STREAMLOAD_DIRECT_IO", raising=False)
    else:
        monkeypatch.setenv("STREAMLOAD_DIRECT_IO", env)
    c = Checkpoint(ckpts["tied"], mode="cold", drop_cache=drop, direct_io=keyword)
    assert c.engine.buffered is not direct
    _check_all(c, ckpts["tied"])
    stats = c.engine.stats
    assert stats.reads > 0
    assert (stats.direct_reads > 0 or stats.direct_refused) if direct else stats.direct_reads == 0
    forced_buffered = c.engine.direct_io is False
    c.engine.read_buffered(False)
    assert c.engine.buffered is forced_buffered
    before = stats.direct_reads
    _check_all(c, ckpts["tied"])
    c.engine.read_buffered(True)
    assert c.engine.buffered is not direct
    c.engine.close()
    if forced_buffered:
        assert stats.direct_reads == before == 0
        return
    if stats.direct_refused:
        pytest.skip("this file system refuses O_DIRECT")
    assert stats.direct_reads > before


def test_a_file_replaced_after_open_is_an_error_not_a_mix(
    tmp_path: Path, ckpts: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reused Checkpoint whose file was replaced (renamed over) after it was opened: the
    header came from the old file, so a reader that opens the path anew (a fresh engine,
    a switch of read mode) raises CheckpointFileError instead of reading the new file's
    bytes at the old offsets."""
    import shutil

    from streamload.errors import CheckpointFileError

    monkeypatch.delenv("STREAMLOAD_DIRECT_IO", raising=False)
    src = Path(ckpts["one_file"])
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    c = Checkpoint(str(ckpt), mode="cold")
    name = c.tensors[0].name
    before = c.read(name).clone()
    path = Path(_paths(str(ckpt))[0])
    swap = path.with_suffix(".new")
    raw = bytearray(path.read_bytes())
    start = c.files[0].data_start
    raw[start:] = bytes(255 - b for b in raw[start:])  # same header, every weight byte differs
    swap.write_bytes(bytes(raw))
    swap.replace(path)
    for _ in range(3):  # a lane reader that kept its descriptor reads the old file; a new one refuses
        try:
            got = c.read(name)
        except CheckpointFileError as exc:
            assert "replaced after the checkpoint was opened" in str(exc)
        else:
            assert torch.equal(bit_view(got), bit_view(before))
    c.engine.read_buffered(not c.engine.buffered)  # new readers open the path again
    with pytest.raises(CheckpointFileError, match="replaced after the checkpoint was opened"):
        c.read(name)
    c.engine.close()


@pytest.mark.parametrize(("in_place", "direct_io"), [(True, None), (False, None), (True, True)])
def test_plain_copies_land_in_place_the_rest_through_the_buffers(
    ckpts: dict[str, str], monkeypatch: pytest.MonkeyPatch, in_place: bool, direct_io: bool | None
) -> None:
    """One batch mixing every kind of copy: buffered, the plain ones (a whole tensor, a row
    slice) are read straight into their destinations; a column slice, a cast, and two
    copies of one tensor go through the read buffers. Same bytes and same byte count as
    the mapped engine in every mode; nothing lands in place when turned off or O_DIRECT."""
    from streamload.io.copy_ops import ST_DTYPES, OpBatch

    monkeypatch.delenv("STREAMLOAD_DIRECT_IO", raising=False)
    ckpt = ckpts["one_file"]
    c = Checkpoint(ckpt, mode="cold")
    first, c.engine = (
        c.engine,
        cold.ColdEngine(c.engine.engine, c.files, in_place=in_place, direct_io=direct_io),
    )
    first.close()
    with safe_open(_paths(ckpt)[0], "pt") as f:
        names = [
            k
            for k in sorted(f.keys())
            if f.get_slice(k).get_shape()[0] > 4 and len(f.get_slice(k).get_shape()) == 2
        ]
        refs = {k: f.get_tensor(k) for k in names[:5]}
    whole, rows, cols, cast, twice = refs
    batch = OpBatch()
    out: dict[str, torch.Tensor] = {}
    expect: dict[str, torch.Tensor] = {}

    def add(tag: str, key: str, region: tuple[slice, slice], dtype: torch.dtype) -> None:
        info, ref = c.info(key), refs[key]
        part = ref[region].to(dtype)
        dst = out[tag] = torch.zeros(part.shape, dtype=dtype)
        expect[tag] = part
        n_cols = ref.shape[1]
        r0, c0 = region[0].start or 0, region[1].start or 0
        batch.add(
            file=info.file_index,
            src=info.begin,
            src_nbytes=info.nbytes,
            src_dtype=info.dtype,
            dst=dst,
            dst_dtype=ST_DTYPES[dtype],
            shape=list(part.shape),
            src_strides=[n_cols, 1],
            dst_strides=[part.shape[1], 1],
            src_offset=r0 * n_cols + c0,
        )

    add("whole", whole, (slice(None), slice(None)), torch.bfloat16)
    add("rows", rows, (slice(1, -1), slice(None)), torch.bfloat16)
    add("cols", cols, (slice(None), slice(2, 9)), torch.bfloat16)
    add("cast", cast, (slice(None), slice(None)), torch.float32)
    add("twice_a", twice, (slice(None), slice(None)), torch.bfloat16)
    add("twice_b", twice, (slice(0, 3), slice(None)), torch.bfloat16)
    nbytes = batch.execute(c.engine, c.files)
    assert nbytes == sum(v.numel() * 2 for v in expect.values())  # source bytes, as the mapped engine
    for tag, ref in expect.items():
        assert torch.equal(bit_view(out[tag]), bit_view(ref)), tag
    landed = (expect["whole"].numel() + expect["rows"].numel()) * 2
    stats = c.engine.stats
    if not c.engine.buffered:
        assert stats.in_place_bytes == 0 and (stats.direct_reads > 0 or stats.direct_refused)
    else:
        assert stats.in_place_bytes == (landed if in_place else 0)
    c.engine.close()


def test_plain_copy_past_its_destination_is_the_engines_error(ckpts: dict[str, str]) -> None:
    """A plain copy whose destination is too small is not read in place: the engine
    reports it as it does for every mode, and nothing is written past the buffer."""
    from streamload.errors import CopyOpError
    from streamload.io.copy_ops import ITEMSIZE, OpBatch

    ckpt = ckpts["one_file"]
    c = Checkpoint(ckpt, mode="cold")
    assert c.engine.buffered and c.engine.lands_in_place
    key = max(c.keys(), key=lambda k: c.info(k).nbytes)
    info = c.info(key)
    room = torch.zeros(info.nbytes + 64, dtype=torch.uint8)
    batch = OpBatch()
    batch.add(
        file=info.file_index,
        src=info.begin,
        src_nbytes=info.nbytes,
        src_dtype=info.dtype,
        dst=room,
        dst_dtype=info.dtype,
        dst_nbytes=info.nbytes - 2,
        shape=[info.nbytes // ITEMSIZE[info.dtype]],
        src_strides=[1],
        dst_strides=[1],
    )
    with pytest.raises(CopyOpError, match="outside the destination"):
        batch.execute(c.engine, c.files)
    assert not room.any() and c.engine.stats.in_place_bytes == 0  # checked before any write
    c.engine.close()


def _op(
    shape: list[int],
    src_strides: list[int],
    dst_strides: list[int],
    *,
    file: int = 0,
    src: int = 0,
    dtypes: tuple[str, str] = ("BF16", "BF16"),
    src_offset: int = 0,
    dst_offset: int = 0,
    dst_nbytes: int = 1 << 30,
    dst: int = 1 << 20,
) -> list[int]:
    """One op row as OpBatch lays it out (csrc/copy_engine.h, CopyOp)."""
    from streamload.io import _native

    pad = _native.MAX_DIMS - len(shape)
    codes = _native.DTYPE_CODES
    return [
        file, src, 1 << 30, codes[dtypes[0]], dst, dst_nbytes, codes[dtypes[1]], len(shape),
        src_offset, dst_offset, *shape, *[1] * pad, *src_strides, *[0] * pad, *dst_strides, *[0] * pad,
    ]  # fmt: skip


def test_in_place_picks_plain_copies_only() -> None:
    """Which ops land in their destinations, decided on the op rows alone: contiguous at both
    ends (dims of one element may have any stride), same dtype, inside the destination, and
    no other op of the chunk reading the same file bytes (other files do not count)."""
    import numpy as np

    class _File:
        path, file_size, data_start, fileno = "/dev/null", 1 << 31, 0, -1

    engine = cold.ColdEngine(None, [_File(), _File()])
    cases = {
        "whole 2-D": (_op([4, 6], [6, 1], [6, 1], src=0), True),
        "expert in a stack (dst offset)": (_op([3, 5], [5, 1], [5, 1], src=100_000, dst_offset=2 * 15), True),
        "dim of one, odd strides": (_op([1, 8], [999, 1], [7, 1], src=200_000), True),
        "3-D contiguous": (_op([2, 3, 4], [12, 4, 1], [12, 4, 1], src=300_000), True),
        "column slice": (_op([4, 3], [6, 1], [3, 1], src=400_000), False),
        "into a column slice": (_op([4, 3], [3, 1], [6, 1], src=450_000), False),
        "null destination": (_op([4, 6], [6, 1], [6, 1], src=480_000, dst=0), False),
        "transposed": (_op([4, 6], [1, 4], [6, 1], src=500_000), False),
        "broadcast (stride 0)": (_op([4, 6], [0, 1], [6, 1], src=600_000), False),
        "reversed (stride -1)": (_op([6], [-1], [1], src=700_000, src_offset=5), False),
        "cast": (_op([4, 6], [6, 1], [6, 1], src=800_000, dtypes=("BF16", "F32")), False),
        "past its destination": (_op([4, 6], [6, 1], [6, 1], src=900_000, dst_nbytes=47), False),
        "shared bytes a": (_op([4, 6], [6, 1], [6, 1], src=1_000_000), False),
        "shared bytes b": (_op([2, 6], [6, 1], [6, 1], src=1_000_000, src_offset=12), False),
        "same offsets, other file": (_op([4, 6], [6, 1], [6, 1], file=1, src=0), True),
    }
    rows = np.array([row for row, _ in cases.values()], dtype=np.int64)
    lo, hi, isz = engine._extents(rows)
    a = engine.data_starts[rows[:, 0]] + rows[:, 1] + lo * isz
    b = engine.data_starts[rows[:, 0]] + rows[:, 1] + (hi + 1) * isz
    got = engine._in_place(rows, a, b, isz)
    assert dict(zip(cases, got.tolist(), strict=True)) == {k: v for k, (_, v) in cases.items()}
    engine.close()


def test_landing_in_place_off_reads_through_the_buffers(
    ckpts: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``in_place=False`` (the engine's own argument): every read goes through the read
    buffers (same bytes); the default lands plain copies in place."""
    monkeypatch.delenv("STREAMLOAD_DIRECT_IO", raising=False)
    c = Checkpoint(ckpts["one_file"], mode="cold")
    c.engine.close()
    c.engine = cold.ColdEngine(c.engine.engine, c.files, in_place=False)
    assert c.engine.buffered and not c.engine.lands_in_place and not c.engine.lands_ahead
    _check_all(c, ckpts["one_file"])
    assert c.engine.stats.reads > 0 and c.engine.stats.in_place_bytes == 0
    c.engine.close()
    c = Checkpoint(ckpts["one_file"], mode="cold")
    assert c.engine.lands_ahead
    _check_all(c, ckpts["one_file"])
    assert c.engine.stats.in_place_bytes > 0
    c.engine.close()
