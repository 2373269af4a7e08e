"""Issue #15, trustworthy defaults, with real gloo ranks (3: uneven shards):
auto never mixes copies of a checkpoint, strict=False never leaves garbage,
mapped parameters own exactly their bytes."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import cases_defaults as cases
import pytest
import torch
from rank_group import RankGroup
from safetensors.torch import load_file, save_file

from streamload.tools.synthetic import make_checkpoint
from streamload.transport.readers import SAMPLE_BYTES, SAMPLES, fingerprint

WORLD = 3


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


def _unsampled_offset(f: Path) -> int:
    """A data byte that none of the fingerprint's sampled blocks covers."""
    size = f.stat().st_size
    start = 8 + struct.unpack("<Q", f.read_bytes()[:8])[0]
    span = size - start - SAMPLE_BYTES
    blocks = [start + span * k // (SAMPLES - 1) for k in range(SAMPLES)]
    gap_start, gap_end = blocks[7] + SAMPLE_BYTES, blocks[8]
    assert gap_end - gap_start > 16, "checkpoint too small to leave a gap between samples"
    return (gap_start + gap_end) // 2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("defaults")
    common = dict(layers=2, num_attention_heads=4, num_key_value_heads=2)
    a = make_checkpoint(
        root / "a", "qwen2", seed=7, vocab=512, hidden_size=64, intermediate_size=128, **common
    )
    # Copy b: same header and the same sampled blocks as a, one byte different elsewhere.
    b = root / "b"
    shutil.copytree(a, b)
    f = b / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[_unsampled_offset(f)] ^= 0x5A
    f.write_bytes(bytes(data))
    assert fingerprint(a) == fingerprint(b)  # the cheap fingerprint cannot tell them apart
    # a without model.norm.weight and lm_head.weight (untied).
    holes = root / "holes"
    shutil.copytree(a, holes)
    sd = load_file(str(holes / "model.safetensors"))
    del sd["model.norm.weight"], sd["lm_head.weight"]
    save_file(sd, str(holes / "model.safetensors"), metadata={"format": "pt"})
    plain = root / "plain"
    plain.mkdir()
    g = torch.Generator().manual_seed(3)
    save_file(
        {"a.weight": torch.randn(12, 16, generator=g), "a.bias": torch.randn(12, generator=g)},
        str(plain / "model.safetensors"),
    )
    # Large enough rows that each rank's shard is >= 256 KiB; 6144 rows shard evenly over 3 ranks.
    big = make_checkpoint(
        root / "big", "qwen2", seed=9, vocab=6144, hidden_size=128, intermediate_size=96, **common
    )
    return {"a": str(a), "b": str(b), "holes": str(holes), "plain": str(plain), "big": str(big)}


def test_auto_does_not_mix_copies(group: RankGroup, ckpts) -> None:
    res = group.run(cases.case_copies, a=ckpts["a"], b=ckpts["b"], readers="auto")
    for r in res:
        assert r["bad"] == [], (r["bad"], r["reader"])  # every rank has rank 0's copy, bit-exact
        assert r["reader"].startswith("src") and "copies" in r["reader"], r["reader"]


def test_owners_is_the_opt_in_that_trusts_copies(group: RankGroup, ckpts) -> None:
    res = group.run(cases.case_copies, a=ckpts["a"], b=ckpts["b"], readers="owners")
    assert all(r["reader"].startswith("owners") and "trusted" in r["reader"] for r in res), res[0]["reader"]


def test_strict_false_on_meta_params_with_real_buffers(group: RankGroup, ckpts) -> None:
    res = group.run(cases.case_strict_false_meta_params, ckpt=ckpts["holes"], full_ckpt=ckpts["a"])
    for r in res:
        assert {"lm_head.weight", "model.norm.weight", "model.extra_scale"} <= set(r["missing"]), r["missing"]
        assert r["bad"] == [], r["bad"]  # everything else as transformers gives it, norm (ones) included
        assert r["extra_kept"] and r["inv_freq_kept"] and r["norm_ones"], r
        # lm_head initialised like transformers' _init_weights: N(0, initializer_range).
        assert abs(r["head_std"] - r["initializer_range"]) < 0.1 * r["initializer_range"], r
        assert abs(r["head_mean"]) < 0.1 * r["initializer_range"], r


def test_strict_false_plain_module(group: RankGroup, ckpts) -> None:
    res = group.run(cases.case_strict_false_plain, ckpt=ckpts["plain"], opaque=False)
    for r in res:
        assert r["missing"] == ["b.bias", "b.weight", "scale"], r
        assert r["a_loaded"] and r["scale_kept"] and r["b_in_bounds"], r
        assert r["b_spread"] > 0.05, r  # reset_parameters' U(-0.29, 0.29), not zeros
    # A meta tensor with no initialiser cannot be filled: a named error on every rank, not garbage.
    res = group.run(cases.case_strict_false_plain, ckpt=ckpts["plain"], opaque=True)
    assert all(r["raised"] == "KeyMismatchError" and r["missing"] == ["opaque.w"] for r in res), res


def test_mapped_parameter_owns_its_bytes(group: RankGroup, ckpts) -> None:
    res = group.run(cases.case_mapped_storage, ckpt=ckpts["big"], map_files=True)
    for r in res:
        assert r["bad"] == [] and r["bytes_mapped"] > 0, r
        assert {name for name, *_ in r["rows"]} >= {"model.embed_tokens.weight", "lm_head.weight"}, r["rows"]
        for name, nbytes, storage, saved in r["rows"]:
            assert storage == nbytes, (name, nbytes, storage)
            assert abs(saved - nbytes) <= 0.01 * nbytes, (name, nbytes, saved)


def test_default_maps_only_what_no_optimizer_writes(group: RankGroup, ckpts) -> None:
    res = group.run(cases.case_mapped_policy, ckpt=ckpts["big"])
    for r in res:
        assert r["bad"] == [], r["bad"]
        assert r["trained_mapped"] == 0, r  # requires_grad=True: private copies
        assert r["writable_mapped"] == 0, r  # frozen, but a save into the files would reach them
    # Frozen, read-only files: most of the payload (every even row range of the file) is mapped views.
    assert sum(r["frozen_mapped"] for r in res) > res[0]["payload"] // 2, res
