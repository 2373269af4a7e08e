"""Saves of TP x FSDP, EP x FSDP and HSDP models on a 2x2 mesh of 4 gloo ranks: the model is
loaded bit-exactly, saved with each writer, and every output file must equal byte for byte
what transformers' own save_pretrained writes for the gathered model (which is the
checkpoint's model: the load is bit-exact); from_pretrained of the output equals it too.
src and owners therefore write the same bytes, and auto picks owners here (one file system)."""

from __future__ import annotations

import warnings
from pathlib import Path

import cases_save_parallel as cases
import pytest
import torch
from rank_group import RankGroup

from streamload.tools.synthetic import make_checkpoint

WORLD = 4
WRITERS = ("owners", "src", "auto")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("save_parallel")
    # vocab 62: 31 rows per tp rank, split 16 / 15 by dp (uneven).
    dense = dict(vocab=62, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    return {
        "llama": str(make_checkpoint(root / "llama", "llama", tie=False, seed=3, layers=2, max_shard_size="16KB", **dense)),
        "qwen3_moe": str(make_checkpoint(root / "qwen3_moe", "qwen3_moe", tie=True, seed=4, num_experts=4, layers=2, max_shard_size="24KB")),
        "qwen3_moe8": str(make_checkpoint(root / "qwen3_moe8", "qwen3_moe", tie=False, seed=7, num_experts=8, layers=2, max_shard_size="24KB")),
    }  # fmt: skip


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _reference(ckpt: str, where: Path) -> Path:
    """transformers' own save of the checkpoint's model (what streamload's save must equal).

    The model is built from its config and given the checkpoint's weights, each in a storage of
    its own as in a sharded model: transformers' shard split groups tensors by storage, and
    from_pretrained's tensors can share one (one per file read), which moves tensors between files.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(ckpt)
        config = AutoConfig.from_pretrained(ckpt)
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # As loaded: transformers saves a model it loaded in natural key order (save/layout.py _as_loaded).
    model._weight_conversions = loaded._weight_conversions
    model.save_pretrained(where, max_shard_size=cases.SHARD)
    return where


def _check(ckpt: str, out: Path, tmp: Path) -> None:
    from transformers import AutoModelForCausalLM

    ref = _reference(ckpt, tmp / f"ref-{out.name}")
    assert _files(out) == _files(ref), f"{out} differs from transformers' save"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = AutoModelForCausalLM.from_pretrained(out).state_dict()
        b = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [p.name for p in tmp.iterdir() if ".streamload-" in p.name]


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_tp_fsdp_save(group: RankGroup, ckpts, tmp_path: Path, model: str) -> None:
    out = tmp_path / "out"
    res = group.run(cases.case_tp_fsdp_save, timeout=300, ckpt=ckpts[model], out=str(out), writers=WRITERS)
    assert all(r["auto"]["writers"] == "owners" for r in res), res
    for w in WRITERS:
        _check(ckpts[model], tmp_path / f"out-{w}", tmp_path)
    # src: the writer wrote every byte, each rank's buffer stayed within the bucket.
    assert res[0]["src"]["bytes"] > 0 and all(r["src"]["peak"] <= cases.BUCKET for r in res), res
    assert sum(r["owners"]["bytes"] for r in res) == res[0]["src"]["bytes"], res
    # Each byte written once: the norms FSDP shards over mesh['dp'] alone are held once per tp
    # coordinate (copies DTensor does not call replicas); one copy writes them.
    assert res[0]["src"]["bytes"] == _weight_bytes(tmp_path / "out-src"), res


def _weight_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*.safetensors"))


def test_ep_fsdp_save(group: RankGroup, ckpts, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = group.run(
        cases.case_ep_fsdp_save, timeout=300, ckpt=ckpts["qwen3_moe8"], out=str(out), writers=WRITERS
    )
    assert any("Shard(dim=0)" in p for p in res[0]["placements"]), res[0]["placements"]
    # The dense weights (FSDP over mesh['dp'] alone) are held once per ep coordinate: written once.
    assert res[0]["saves"]["src"]["bytes"] == _weight_bytes(tmp_path / "out-src"), res
    assert sum(r["saves"]["owners"]["bytes"] for r in res) == res[0]["saves"]["src"]["bytes"], res
    for w in WRITERS:
        _check(ckpts["qwen3_moe8"], tmp_path / f"out-{w}", tmp_path)


def test_hsdp_one_replica_writes(group: RankGroup, ckpts, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = group.run(
        cases.case_hsdp_save, timeout=300, ckpt=ckpts["llama"], out=str(out), writers=("owners", "src")
    )
    for w in ("owners", "src"):
        _check(ckpts["llama"], tmp_path / f"out-{w}", tmp_path)
    # owners: the second replica writes nothing, the first writes everything between its ranks.
    assert [r["saves"]["owners"]["bytes"] for r in res if r["replica"] == 1] == [0, 0], res
    assert all(r["saves"]["owners"]["bytes"] > 0 for r in res if r["replica"] == 0), res
    assert sum(r["saves"]["owners"]["bytes"] for r in res) == res[0]["saves"]["src"]["bytes"], res


def test_pipeline_stages_save_over_their_own_2d_mesh(group: RankGroup, ckpts, tmp_path: Path) -> None:
    """Two pipeline stages save two models at once, each over its 2-D ``mesh["dp", "tp"]``
    (2 of the 4 ranks): both outputs equal transformers' save, each byte written once."""
    pair = (ckpts["llama"], ckpts["qwen3_moe"])
    out = tmp_path / "out"
    res = group.run(cases.case_pp_stage_save, timeout=300, ckpts=pair, out=str(out), writers=("owners", "src"))
    assert [r["stage"] for r in res] == [0, 0, 1, 1] and {r["world_sum"] for r in res} == {4.0}, res
    # src_rank is global: stage 1's group [2, 3] does not hold the default 0 (named, both ranks).
    assert all("src_rank=0 is not a rank of the load's group (global ranks [2, 3])" in r["error"] for r in res[2:])
    for stage, ckpt in enumerate(pair):
        mine = [r["saves"] for r in res if r["stage"] == stage]
        for w in ("owners", "src"):
            _check(ckpt, tmp_path / f"out{stage}-{w}", tmp_path)
        written = _weight_bytes(tmp_path / f"out{stage}-src")
        assert sum(s["owners"]["bytes"] for s in mine) == written == mine[0]["src"]["bytes"], res
