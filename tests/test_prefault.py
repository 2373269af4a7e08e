"""Prefault: fresh CPU shards get their pages on a helper thread, and not a byte changes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from pages import resident

from streamload.transport.prefault import PAGE, page_ranges, prefault


def test_prefault_populates_fresh_memory_without_changing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = torch.empty(48 << 20, dtype=torch.uint8)  # large: its own mapping, no pages yet
    if resident(fresh) > 0.5:
        pytest.skip("the allocator handed out memory that was already touched")
    written = torch.empty(16 << 20, dtype=torch.uint8)
    worker = prefault([fresh, written])
    assert worker is not None
    # Written while the helper populates the same pages: every byte stays as written.
    pattern = torch.arange(written.numel(), dtype=torch.int64).remainder_(251).to(torch.uint8)
    written.copy_(pattern)
    worker.join(30)
    assert not worker.is_alive()
    assert torch.equal(written, pattern)
    populated = resident(fresh)
    if populated < 0.99:
        pytest.skip(f"MADV_POPULATE_WRITE not supported here (resident {populated:.0%})")


def test_prefault_keyword_and_its_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefault=False`` turns it off; not given, STREAMLOAD_PREFAULT=0 does; a keyword passed
    explicitly wins over the variable."""
    monkeypatch.delenv("STREAMLOAD_PREFAULT", raising=False)
    shard = torch.empty(1 << 20, dtype=torch.uint8)
    assert prefault([shard], False) is None
    on = prefault([shard])
    assert on is not None
    on.join(30)
    monkeypatch.setenv("STREAMLOAD_PREFAULT", "0")
    assert prefault([shard]) is None
    forced = prefault([shard], True)
    assert forced is not None
    forced.join(30)


def test_page_ranges_merge_and_skip_empty() -> None:
    base = torch.empty(5 * PAGE, dtype=torch.uint8)
    views = [base[:PAGE], base[2 * PAGE :]]  # one storage: one range
    (a, b), *rest = page_ranges([*views, torch.empty(0)])
    assert not rest
    assert a <= base.data_ptr() < a + PAGE and b >= base.data_ptr() + base.numel()
    assert page_ranges([]) == []


@pytest.mark.parametrize(
    ("keyword", "env", "asked"), [(None, None, None), (False, None, False), (None, "0", None)]
)
def test_the_load_passes_its_prefault_keyword_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyword: bool | None, env: str | None, asked: bool | None
) -> None:
    """``load_checkpoint(prefault=...)`` reaches the pipeline's prefault call as given (None:
    not given, which is where STREAMLOAD_PREFAULT then decides); the load is right either way."""
    from safetensors.torch import save_file
    from torch import nn

    import streamload
    import streamload.transport.stream as stream

    if env is None:
        monkeypatch.delenv("STREAMLOAD_PREFAULT", raising=False)
    else:
        monkeypatch.setenv("STREAMLOAD_PREFAULT", env)
    weights = {"weight": torch.randn(6, 4), "bias": torch.randn(6)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    seen: list[bool | None] = []
    real = stream.prefault

    def spy(tensors: list[torch.Tensor], enabled: bool | None = None) -> threading.Thread | None:
        seen.append(enabled)
        return real(tensors, enabled)

    populated: list[bool] = []
    real_populate = stream.populate_on_copy

    def spy_populate(engine: object, enabled: bool | None = None) -> None:
        real_populate(engine, enabled)
        populated.append(engine.populate)  # type: ignore[attr-defined]

    monkeypatch.setattr(stream, "prefault", spy)
    monkeypatch.setattr(stream, "populate_on_copy", spy_populate)
    model = nn.Linear(4, 6)
    streamload.load_checkpoint(model, tmp_path, progress=False, prefault=keyword)
    assert seen == [asked]
    # The copy engine's per-piece populate follows the same keyword and variable.
    assert populated == [keyword is not False and env != "0"]
    assert torch.equal(model.weight, weights["weight"]) and torch.equal(model.bias, weights["bias"])
