"""Every causal-LM architecture transformers registers, shrunk generically,
saved with save_pretrained and loaded by streamload at 2 ranks: every
parameter and buffer bit for bit as transformers' from_pretrained, alias
groups as transformers' own on every rank. The full sweep is slow (opt in
with --runslow); a representative subset runs by default."""

from __future__ import annotations

from pathlib import Path

import cases_arch
import pytest
from arch_sweep import summary, sweep
from rank_group import RankGroup

from streamload.tools.archs import build_checkpoint, causal_lm_types

# The three named in issue #19 (bailing_hybrid: a key rename, on a hybrid
# linear/full attention stack; fuyu: a legacy key mapping; codegen: a buffer
# computed in __init__ under the load dtype), then fused projections split by
# their targets' sizes (sarvam_moe, from a per-expert MoE), a composite model
# tied through its top config only (moss_transcribe_diarize), and Conv1D
# blocks under transformer.h (gpt2).
FAST = ["bailing_hybrid", "fuyu", "codegen", "sarvam_moe", "moss_transcribe_diarize", "gpt2"]


@pytest.fixture(scope="module")
def group():
    g = RankGroup(2)
    yield g
    g.close()


def _check(outcomes) -> None:
    report = summary(outcomes)
    print(report)
    failed = [o for o in outcomes if o.status == "failed"]
    assert not failed, report


@pytest.mark.timeout(300)
def test_representative_architectures(group: RankGroup, tmp_path: Path) -> None:
    outcomes = sweep(FAST, tmp_path, group=group)
    assert [o.model_type for o in outcomes if o.status == "loaded"] == FAST, summary(outcomes)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_every_causal_lm_architecture(group: RankGroup, tmp_path: Path) -> None:
    outcomes = sweep(causal_lm_types(), tmp_path, group=group)
    _check(outcomes)
    assert sum(o.status == "loaded" for o in outcomes) > len(outcomes) // 2, summary(outcomes)


def test_sharded_model_finds_its_conversion_mapping(group: RankGroup, tmp_path: Path) -> None:
    """bailing_hybrid's rename is registered under its model type; fully_shard's
    FSDP<Name> class (defined in torch) reads as custom code and hid it."""
    built = build_checkpoint("bailing_hybrid", tmp_path / "bh")
    for res in group.run(cases_arch.case_unsharded_classes, ckpt=str(built.path), ws=2):
        assert res["inside"] == res["plain"]
        assert any("word_embeddings" in m for m in res["plain"])
        # What transformers sees without the swap back (why it is needed).
        assert res["bare"] != res["plain"]
