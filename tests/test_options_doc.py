"""docs/options.md is the one place options are documented: every STREAMLOAD_* name the code
reads or defines, every keyword of load_checkpoint, from_pretrained and save_pretrained, and each environment
override beside the keyword it overrides."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from streamload import from_pretrained, load_checkpoint, save_pretrained
from streamload.options import ENV_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "options.md"
NAME = re.compile(r"STREAMLOAD_[A-Z0-9_]+")


def _sources() -> list[Path]:
    files = [ROOT / "CMakeLists.txt", ROOT / "pyproject.toml"]
    for folder, pattern in (("streamload", "*.py"), ("csrc", "*")):
        files += [
            p for p in sorted((ROOT / folder).rglob(pattern)) if p.is_file() and "__pycache__" not in p.parts
        ]
    return files


def _names_in(text: str) -> set[str]:
    return {m.rstrip("_") for m in NAME.findall(text)}


def test_every_streamload_name_in_the_code_is_documented() -> None:
    doc = _names_in(DOC.read_text())
    found: dict[str, str] = {}
    for path in _sources():
        for name in _names_in(path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    assert {"STREAMLOAD_DIRECT_IO", "STREAMLOAD_SANITIZE"} <= set(found)  # the scan sees the code
    missing = {name: where for name, where in found.items() if name not in doc}
    assert not missing, f"not in docs/options.md: {missing}"


def _documented_keywords(section: str) -> set[str]:
    """Backquoted names in the first column of the table under the heading starting ``section``."""
    text = DOC.read_text()
    start = text.index(f"## `{section}")
    body = text[start : text.find("\n## ", start + 1)]
    rows = [line.split("|")[1] for line in body.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`(\w+)`", cell)}


def test_every_keyword_is_documented() -> None:
    load = [p for p in inspect.signature(load_checkpoint).parameters if p not in ("model", "path")]
    missing = set(load) - _documented_keywords("load_checkpoint")
    assert not missing, f"load_checkpoint keywords not in docs/options.md: {sorted(missing)}"
    own = [p for p, v in inspect.signature(from_pretrained).parameters.items() if v.kind is not v.VAR_KEYWORD]
    missing = set(own) - _documented_keywords("from_pretrained")
    assert not missing, f"from_pretrained keywords not in docs/options.md: {sorted(missing)}"
    save = [p for p in inspect.signature(save_pretrained).parameters if p not in ("model", "out_dir")]
    assert "writers" in save  # the signature is read, not an empty list
    missing = set(save) - _documented_keywords("save_pretrained")
    assert not missing, f"save_pretrained keywords not in docs/options.md: {sorted(missing)}"


def test_each_override_sits_beside_its_keyword() -> None:
    """The overrides table is options.py's: one row per variable, naming the keyword it overrides,
    and that keyword defaults to None (not given) so that the variable can apply."""
    text = DOC.read_text()
    start = text.index("## Environment overrides")
    body = text[start : text.index("\n## ", start + 1)]
    rows = {
        cells[1].strip("` "): cells[2].strip("` ")
        for line in body.splitlines()
        if line.startswith("| `STREAMLOAD_") and (cells := line.split("|"))
    }
    assert rows == {var: kw for kw, var in ENV_OVERRIDES.items()}
    params = inspect.signature(load_checkpoint).parameters
    assert all(params[kw].default is None for kw in ENV_OVERRIDES)
