"""Environment overrides (streamload/options.py): one rule for every keyword that has one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import streamload
from streamload.options import ENV_OVERRIDES, env_flag, env_text
from streamload.transport.readers import node_key


@pytest.mark.parametrize("keyword", ["direct_io", "prefault", "progress"])
def test_a_flag_keyword_given_wins_else_its_variable(keyword: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name = ENV_OVERRIDES[keyword]
    monkeypatch.delenv(name, raising=False)
    assert env_flag(keyword, None) is None  # neither said: the keyword's own default
    assert env_flag(keyword, True) is True and env_flag(keyword, False) is False
    for raw, want in [("1", True), ("TRUE", True), (" on ", True), ("0", False), ("no", False), ("", None)]:
        monkeypatch.setenv(name, raw)
        assert env_flag(keyword, None) is want, raw
    monkeypatch.setenv(name, "0")
    assert env_flag(keyword, True) is True  # explicit beats the variable
    monkeypatch.setenv(name, "1")
    assert env_flag(keyword, False) is False
    monkeypatch.setenv(name, "2")
    with pytest.raises(ValueError, match=f"{name}='2'.*{keyword}"):
        env_flag(keyword, None)


def test_node_keyword_beats_its_variable_and_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_RANK", "7")
    monkeypatch.delenv("STREAMLOAD_NODE", raising=False)
    assert node_key() == "7" and node_key("rack-a") == "rack-a"
    monkeypatch.setenv("STREAMLOAD_NODE", "b")
    assert env_text("node", None) == "b" and node_key() == "b"
    assert node_key("rack-a") == "rack-a"
    monkeypatch.setenv("STREAMLOAD_NODE", "  ")
    assert env_text("node", None) is None and node_key() == "7"


@pytest.mark.parametrize("name", ["STREAMLOAD_PREFAULT", "STREAMLOAD_PROGRESS"])
def test_a_malformed_override_fails_the_load_before_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A variable read only once the pipeline runs is checked in prepare, inside the agreement
    every rank takes part in, so a bad value is an error on every rank, never a rank that
    raises alone while the others wait in the stream."""
    import streamload.transport.strategies as strategies

    save_file({"weight": torch.randn(3, 2)}, str(tmp_path / "model.safetensors"))

    def started(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the stream started")

    monkeypatch.setattr(strategies, "scatter", started)
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(ValueError, match=name):
        streamload.load_checkpoint(nn.Linear(2, 3, bias=False), tmp_path)


def test_from_pretrained_passes_threads_to_the_load(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``threads`` reaches both the reader's open and the load's options (ranks that read their
    own shards open their files with ``LoadOptions.threads``)."""
    import streamload
    from streamload.integrations import pretrained
    from streamload.tools.synthetic import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2", seed=1, layers=1, vocab=32)
    seen: dict[str, object] = {}
    run_load = pretrained.run_load

    def recording(model, path, options, opened, *rest):  # type: ignore[no-untyped-def]
        seen["threads"] = options.threads
        return run_load(model, path, options, opened, *rest)

    monkeypatch.setattr(pretrained, "run_load", recording)
    streamload.from_pretrained(ckpt, threads=1)
    assert seen == {"threads": 1}
