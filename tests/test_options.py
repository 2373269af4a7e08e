"""Environment overrides (streamload/options.py): one rule for every keyword that has one."""

from __future__ import annotations

import pytest

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
