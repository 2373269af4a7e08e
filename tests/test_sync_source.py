"""HubSource: the trainer's weights in hub layout, a layer group at a time with one collective
each, equal to transformers' save_pretrained of the gathered model (gloo ranks)."""

from __future__ import annotations

import cases_sync as cases
import pytest
import torch
from rank_group import RankGroup

from streamload.sync.groups import layer_groups, plan_groups
from streamload.tools.synthetic import make_checkpoint

MODELS = {
    "qwen2": dict(tie=True),  # dense, tied embeddings (lm_head stored once)
    "llama": dict(tie=False),  # dense, untied
    "qwen3_moe": dict(num_experts=5, tie=False),  # fused experts -> per-expert hub tensors
}


def test_layer_groups_key_on_the_outermost_index() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight",
    ]
    assert layer_groups(names) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"],
        ["model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.input_layernorm.weight"],
        ["model.norm.weight", "lm_head.weight"],
    ]


def test_group_buffers_are_aligned_words() -> None:
    (g,) = plan_groups([("a", "BF16", (3,)), ("b", "F32", (5,)), ("c", "I64", (1,))])
    assert [s.offset for s in g.slots] == [0, 64, 128]
    assert g.nbytes % 8 == 0 and g.nbytes >= 136


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sync_src")
    return {
        mt: str(make_checkpoint(root / mt, mt, seed=31 + i, **kw))
        for i, (mt, kw) in enumerate(MODELS.items())
    }


@pytest.fixture(scope="module")
def group():
    g = RankGroup(3)
    yield g
    g.close()


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("mt", list(MODELS))
def test_source_equals_transformers_save(group: RankGroup, ckpts, ws: int, mt: str) -> None:
    res = group.run(cases.case_source, ckpt=ckpts[mt], ws=ws, timeout=120)[:ws]
    for r in res:
        # one all_reduce per layer group per pass (two passes and the plain iterator: three)
        assert r["collectives"] == {"all_reduce": 3 * r["groups"]}, r["collectives"]
        assert r["stats"].per_pass == [r["groups"]] * 3
        # every group's collective is issued before its tensors are yielded: group k has k+1 behind it
        assert r["per_group"][: r["groups"]] == list(range(1, r["groups"] + 1))
        # peak extra memory: one group, far from the model (no full model, no fused full tensor)
        assert r["stats"].peak_group_bytes == r["largest_group"]
        assert r["largest_group"] * 2 < r["model_bytes"], (r["largest_group"], r["model_bytes"])
        assert 0 < r["allocated"] <= r["largest_group"], (r["allocated"], r["largest_group"])
        assert r["received"] > 0
        assert r["partly_zeroed"] == r["groups"], r  # and still equal to transformers' save
        # one buffer kept between passes (the later passes reused it: still equal)
        assert r["kept"] == r["largest_group"], r
        assert r["kept_after_flat"] == 0  # every tensor of the last pass still held: nothing kept


def test_source_casts_and_one_receiver(group: RankGroup, ckpts) -> None:
    # bf16 on the wire, as save_pretrained(dtype=torch.bfloat16) writes it
    group.run(cases.case_source, ckpt=ckpts["qwen3_moe"], ws=3, dtype=torch.bfloat16, passes=1)
    # one receiving rank: a reduce per group, the others yield None; no buffer kept when asked
    res = group.run(cases.case_source, ckpt=ckpts["qwen2"], ws=3, receivers=1, passes=1, keep_buffer=False)
    assert [r["received"] > 0 for r in res] == [False, True, False]
    assert [r["kept"] for r in res] == [0, 0, 0]
    assert all(r["collectives"] == {"reduce": 2 * r["groups"]} for r in res)


@pytest.mark.parametrize("mt", ["qwen2", "qwen3_moe"])
def test_a_pass_holds_one_group_at_a_time(group: RankGroup, ckpts, mt: str) -> None:
    """Peak extra memory is one group: when a group is materialised no earlier group's buffer is
    alive, even with the consumer holding the last tensor it took (the group's smallest, yielded
    as a copy of its own); only a group of one tensor (the embeddings, sent without an alias) is
    still held then, by that tensor. Before: every earlier group was held at the next one."""
    res = group.run(cases.case_groups_held, ckpt=ckpts[mt], ws=2)[:2]
    for r in res:
        assert r["alive"] == r["expected"] and sum(r["expected"]) <= 1, r


def test_group_buffers_are_reused_once_nothing_holds_them() -> None:
    """A pass reuses a group buffer's memory for a later group only when no tensor of the earlier
    group is alive (zeroed again); a buffer someone still holds is never handed out."""
    from streamload.sync.buffers import BufferPool

    pool = BufferPool(torch.device("cpu"))
    a = pool.take(1000, 4096)
    a.fill_(7)
    ptr = a.data_ptr()
    view = a[10:20]
    b = pool.take(2000, 4096)  # `a` is still held (and its view): new memory
    assert b.data_ptr() != ptr and int(b.sum()) == 0
    del a
    c = pool.take(3000, 4096)  # the view still holds the first buffer
    assert c.data_ptr() not in (ptr, b.data_ptr())
    del view, b
    d = pool.take(4000, 4096)  # nothing holds the first buffer now: reused, zeroed
    assert d.data_ptr() == ptr and d.numel() == 4000 and int(d.sum()) == 0
    pool.clear()
    assert pool.arrays == []


def test_a_reused_buffer_is_zeroed_where_the_pack_does_not_write() -> None:
    """A reused buffer is zeroed only outside this rank's pieces (the pack writes over the rest:
    zeroing it too doubled the pack's memory writes); a piece that is not one contiguous block
    (a shard along dim 1) zeroes the whole buffer, as before."""
    from streamload.sync.buffers import BufferPool, zero_gaps

    meta = torch.empty(72, dtype=torch.uint8, device="meta")
    w = meta[:64].view(torch.float32).view(4, 4)
    gaps = zero_gaps(72, [w[2:4], meta[0:8]])  # rows 2-3 of a (4, 4) tensor, a leading word
    assert gaps == [(8, 32), (64, 72)]
    assert zero_gaps(72, [w[:, 2:]]) is None
    assert zero_gaps(72, [w[:0]]) == [(0, 72)]
    pool = BufferPool(torch.device("cpu"))
    a = pool.take(72, 72)
    ptr = a.data_ptr()
    a.fill_(7)
    del a
    b = pool.take(72, 72, gaps)
    assert b.data_ptr() == ptr
    assert b[8:32].eq(0).all() and b[64:].eq(0).all() and b[:8].eq(7).all() and b[32:64].eq(7).all()
    del b
    c = pool.take(72, 72, None)
    assert c.data_ptr() == ptr and int(c.sum()) == 0


def test_a_free_buffer_is_kept_for_the_next_pass() -> None:
    """``clear(keep=True)`` keeps one array nothing holds (its pages stay resident: the next pass
    faults nothing in); an array a tensor still holds is never kept, and ``clear()`` keeps none."""
    from streamload.sync.buffers import BufferPool

    pool = BufferPool(torch.device("cpu"))
    a = pool.take(1000, 4096)
    ptr = a.data_ptr()
    a.fill_(7)
    del a
    assert pool.clear(keep=True) == 1 and pool.kept_bytes == 4096
    b = pool.take(2000, 4096, [(0, 2000)])  # the next pass: the kept memory, zeroed where asked
    assert b.data_ptr() == ptr and int(b.sum()) == 0
    pool.clear(keep=True)  # `b` still holds it: not kept
    assert pool.kept_bytes == 0
    c = pool.take(100, 4096)
    assert c.data_ptr() != ptr
    del b, c
    pool.clear(keep=True)
    assert pool.kept_bytes == 4096
    pool.clear()
    assert pool.kept_bytes == 0 and pool.arrays == []


def _plain_model(tmp_path, mt: str, tie: bool):  # type: ignore[no-untyped-def]
    import streamload

    path = make_checkpoint(str(tmp_path / mt), mt, dtype=torch.float32, seed=3, hidden_size=64,
                           num_attention_heads=2, num_key_value_heads=1, layers=2, vocab=4096, tie=tie,
                           intermediate_size=64)  # fmt: skip
    return streamload.from_pretrained(str(path), dtype=torch.float32, progress=False)


def test_a_pass_that_ends_early_or_fails_leaves_no_buffer_behind(tmp_path, monkeypatch) -> None:
    """``keep_buffer=False`` keeps nothing however a pass ends: a consumer that stops early (the
    generator closed at a group boundary), a rank whose pack raises (its error's traceback no longer
    pins the buffer it was packing, while the error is still alive). ``keep_buffer=True`` keeps
    only a free buffer after a consumer stopped early."""
    import weakref

    import streamload.sync.source as source_mod
    from streamload.sync.buffers import BufferPool
    from streamload.sync.errors import SyncError
    from streamload.sync.source import HubSource

    model = _plain_model(tmp_path, "llama", tie=False)
    made: list[weakref.ref] = []
    clear = BufferPool.clear

    def seen(self: BufferPool, keep: bool = False) -> int:
        made.extend(self.made)
        return clear(self, keep)

    monkeypatch.setattr(BufferPool, "clear", seen)
    src = HubSource(model, keep_buffer=False)
    assert len(src.groups()) >= 3
    for i, _group in enumerate(src.iter_groups()):
        if i == 1:
            break  # the generator is closed here, at a group boundary
    del _group  # the consumer's own hold on the last group
    assert src.kept_bytes == 0 and src._pool.arrays == []
    assert made and all(r() is None for r in made)
    src.keep_buffer = True
    for i, (_names, tensors) in enumerate(src.iter_groups()):
        del tensors
        if i == 1:
            break
    assert src.kept_bytes == src.largest_group_bytes

    src.keep_buffer = False
    made.clear()
    region = source_mod._region

    def failing(slot, piece, buf):  # type: ignore[no-untyped-def]
        if slot.name.startswith("model.layers.1."):
            raise RuntimeError("injected pack failure")
        return region(slot, piece, buf)

    monkeypatch.setattr(source_mod, "_region", failing)
    with pytest.raises(SyncError, match="injected pack failure") as info:
        for _ in src:
            pass
    assert info.value.tensor is not None and info.value.tensor.startswith("model.layers.1.")
    assert src.kept_bytes == 0 and made and all(r() is None for r in made), "a buffer outlived the pass"


def test_held_tensors_move_off_their_buffer_and_tied_embeddings_go_last(tmp_path) -> None:
    """A consumer that keeps tensors of a group (vLLM's loops keep the last ones they passed on) keeps
    the same objects with the same values, moved off the group buffer when the next group is made, so
    one buffer is alive at a time. A tied embedding with its alias (as large as their group: a hold on
    it would pin the group) is sent last, in the final group: the order of the lower planned peak,
    still vLLM's partition of the names in that order."""
    from streamload.sync.buffers import planned_peak
    from streamload.sync.source import HubSource

    model = _plain_model(tmp_path, "qwen2", tie=True)
    src = HubSource(model, aliases={"model.embed_tokens.weight": ["lm_head.weight"]})
    groups = src.groups()
    assert groups[-1][:2] == ["model.embed_tokens.weight", "lm_head.weight"], groups
    assert groups == layer_groups([m.name for m in src.metadata()])
    first = HubSource(model, aliases={"model.embed_tokens.weight": ["lm_head.weight"]})
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    last = None
    for name, t in src:
        assert t is not None
        last = t  # noqa: F841 - held while the next is asked for, as a consumer's loop variable is
        if name.endswith("norm.weight"):
            kept.append((t, t.clone()))  # and some small ones kept for good
    assert src.stats.held_groups == 1 and src.stats.moved_bytes > 0, src.stats
    assert all(torch.equal(t, want) for t, want in kept)
    assert planned_peak(src.planned_groups) <= planned_peak(first._plan(_entries(first), first.aliases))


def test_a_large_hold_keeps_its_buffer_untouched(tmp_path) -> None:
    """A consumer that keeps over half of a group (here: all of the first, as an engine buffering a
    layer would) keeps that group's buffer: it is neither moved (that would double it) nor reused or
    overwritten while later groups are made (held_groups 2)."""
    from streamload.sync.source import HubSource

    model = _plain_model(tmp_path, "llama", tie=False)
    src = HubSource(model)
    first = src.groups()[0]
    it = iter(src)
    held = [next(it) for _ in first]
    want = [t.clone() for _, t in held]
    rest = [(n, t.clone()) for n, t in it]  # every later group made while the first is held
    assert [n for n, _ in held] == first and len(rest) > 10
    assert all(torch.equal(t, w) for (_, t), w in zip(held, want, strict=True))
    assert len({t.untyped_storage().data_ptr() for _, t in held}) == 1  # not moved: still the buffer
    assert src.stats.held_groups == 2, src.stats


def _entries(src):  # type: ignore[no-untyped-def]
    """The hub tensors in the layout's own order (embeddings first)."""
    return [(n, h.dtype, h.shape) for n, h in src.layout.tensors.items()]


def test_torch_use_counts_mean_what_the_move_relies_on() -> None:
    """let_go reads two private torch counters (``Tensor._use_count``, ``torch._C._storage_Use_Count``)
    to move only tensors nothing else sees. If torch changes what they count, this fails loudly."""
    buf = torch.zeros(64, dtype=torch.uint8)
    st = buf.untyped_storage()
    a = torch.empty(0).set_(st, 0, (4,), (1,))
    b = torch.empty(0).set_(st, 4, (4,), (1,))
    del buf, st
    uses = lambda t: torch._C._storage_Use_Count(t.untyped_storage()._cdata)  # noqa: E731
    assert a._use_count() == 1 and uses(a) == 3  # a, b and the temporary storage object
    view = a[1:3]
    assert a._use_count() == 2 and uses(a) == 4
    del view
    capsule = torch.utils.dlpack.to_dlpack(a)
    assert a._use_count() == 2
    del capsule
    assert a._use_count() == 1 and b._use_count() == 1


def test_a_hold_nothing_may_lose_is_never_moved() -> None:
    """Held tensors are moved off their buffer only when nothing else sees them: not with a view or
    a DLPack export of one (they would keep reading the old memory), not aliases (they would stop
    sharing), and an inference tensor outside inference mode just keeps its buffer (no raise)."""
    import weakref

    from streamload.sync.buffers import let_go

    def group() -> tuple[torch.Tensor, list[torch.Tensor], int]:
        buf = torch.arange(256, dtype=torch.uint8)
        st = buf.untyped_storage()
        ts = [torch.empty(0, dtype=torch.uint8).set_(st, o, (16,), (1,)) for o in (0, 16, 128)]
        return buf, ts, st.data_ptr()

    buf, ts, at = group()
    last = ts[-1]
    del buf, ts
    assert let_go([weakref.ref(last)], at, 256) == 16  # moved: same object, same values, own memory
    assert last.untyped_storage().data_ptr() != at and last.tolist() == list(range(128, 144))

    buf, ts, at = group()
    last, view = ts[-1], ts[-1][2:4]
    del buf, ts
    assert let_go([weakref.ref(last)], at, 256) == 0 and last.untyped_storage().data_ptr() == at
    del view

    buf, ts, at = group()
    last = ts[-1]
    capsule = torch.utils.dlpack.to_dlpack(last)
    del buf, ts
    assert let_go([weakref.ref(last)], at, 256) == 0 and last.untyped_storage().data_ptr() == at
    del capsule

    buf, ts, at = group()
    alias = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage(), 128, (16,), (1,))
    last = ts[-1]
    del buf, ts
    assert let_go([weakref.ref(last), weakref.ref(alias)], at, 256) == 0

    with torch.inference_mode():
        buf, ts, at = group()
    last = ts[-1]
    del buf, ts
    assert let_go([weakref.ref(last)], at, 256) == 0 and last.tolist() == list(range(128, 144))
