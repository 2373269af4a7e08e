"""The subpackages draw the data flow: a lower layer never imports a higher one.

checkpoint files (io) -> plan -> transport -> load -> integrations / tools; model (the model's
state, ties and buffers) sits beside plan and transport. The file layer sees only itself and the
shared leaves (errors, timeline); the planner never reaches the transport or the drivers. Checked on the source (every import, lazy ones inside functions included), so a
cycle cannot creep back in through a function-level import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "streamload"
LEAVES = {"errors", "timeline", "report", "options", "_streamload"}
# What each layer may import besides itself and the leaves.
ALLOWED = {
    "io": set(),
    "plan": {"io", "model"},
    "model": {"io", "plan", "transport"},
    "transport": {"io", "plan", "model"},
}


def _imported_subpackages(source: str, depth: int) -> set[str]:
    """Top-level streamload subpackages that a module ``depth`` folders below streamload/ imports."""
    out: set[str] = set()
    tree = ast.parse(source)
    typing_only = {  # annotations only: no import at run time
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level <= depth:
                    continue  # within the same subpackage
                parts = (node.module or "").split(".")
                names = [parts[0]] if parts[0] else [a.name for a in node.names]
            elif (node.module or "").startswith("streamload."):
                names = [node.module.split(".")[1]]  # type: ignore[union-attr]
            else:
                continue
            out.update(names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("streamload."))
    return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_what_lies_below(layer: str) -> None:
    bad = {}
    for path in sorted((PKG / layer).rglob("*.py")):
        depth = len(path.relative_to(PKG).parts) - 1  # 1 for streamload/io/x.py
        reached = _imported_subpackages(path.read_text(), depth) - {layer} - LEAVES - ALLOWED[layer]
        if reached:
            bad[str(path.relative_to(PKG))] = sorted(reached)
    assert not bad, f"{layer} imports layers above it: {bad}"


def test_no_subpackage_name_that_tools_read_as_build_output() -> None:
    reserved = {"dist", "build", "out"}
    assert not [p for p in PKG.rglob("*") if p.is_dir() and p.name in reserved]


def test_the_check_sees_a_violation() -> None:
    """The import scan is not blind: each way of reaching the planner from the file layer is caught."""
    lazy = "def f():\n    from ..plan.quant import QuantTensor\n"
    assert _imported_subpackages(lazy, 1) == {"plan"}
    assert _imported_subpackages("from .. import plan\nfrom . import copy_ops\n", 1) == {"plan"}
    assert _imported_subpackages("import streamload.plan.quant\n", 1) == {"plan"}
    assert _imported_subpackages("from ...plan import x\n", 2) == {"plan"}  # from io/sub/x.py
    assert _imported_subpackages("from ..sub import x\n", 2) == set()
    assert _imported_subpackages("if TYPE_CHECKING:\n    from ..plan import quant\n", 1) == set()
