"""Every causal-LM architecture transformers registers, shrunk generically,
saved with save_pretrained and loaded by streamload at 2 ranks: every
parameter and buffer bit for bit as transformers' from_pretrained, alias
groups as transformers' own on every rank. The full sweep is slow (opt in
with --runslow); a representative subset runs by default."""

from __future__ import annotations

from pathlib import Path

import pytest
from arch_sweep import sweep, summary

from streamload.tools.archs import causal_lm_types

# The three named in issue #19 (a key rename, a legacy key mapping, a buffer
# computed in __init__ under the load dtype), then per-expert MoE fusion,
# Conv1D blocks, and a hybrid recurrent/attention stack.
FAST = ["bailing_hybrid", "fuyu", "codegen", "qwen3_moe", "gpt2", "gemma2"]


def _check(outcomes) -> None:
    report = summary(outcomes)
    print(report)
    failed = [o for o in outcomes if o.status == "failed"]
    assert not failed, report


@pytest.mark.timeout(300)
def test_representative_architectures(tmp_path: Path) -> None:
    outcomes = sweep(FAST, tmp_path)
    assert [o.model_type for o in outcomes if o.status == "loaded"] == FAST, summary(outcomes)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_every_causal_lm_architecture(tmp_path: Path) -> None:
    outcomes = sweep(causal_lm_types(), tmp_path)
    _check(outcomes)
    assert sum(o.status == "loaded" for o in outcomes) > len(outcomes) // 2, summary(outcomes)
