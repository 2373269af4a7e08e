"""verl 0.9.1's own FSDP engine build (FSDPEngine._build_module + _build_fsdp_module:
get_init_weight_context_manager, from_pretrained, apply_fsdp2, fsdp2_load_full_state_dict)
on CPU gloo ranks, verl's loader against streamload's swapped in, bit for bit; the tie x FSDP
agreement (TieError on every rank, never a hang), ``buffers=`` and CPU offload."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from rank_group import RankGroup

# Skipped only where verl is not installed at all: an installed verl that fails to import (a
# dependency missing from the clients extra) is an error, never a silent skip.
if importlib.util.find_spec("verl") is None:
    pytest.skip(
        "verl is a client extra: pip install --no-deps -r .ci/clients-nodeps.txt", allow_module_level=True
    )

import cases_verl as cases  # noqa: E402 - needs verl

from streamload.tools.synthetic import make_checkpoint  # noqa: E402

SMALL = dict(vocab=97, hidden_size=24, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("verl_client")
    return {
        "tied": str(
            make_checkpoint(
                root / "tied", "qwen2", tie=True, seed=31, layers=2, max_shard_size="16KB", **SMALL
            )
        ),
        "untied": str(make_checkpoint(root / "untied", "qwen2", tie=False, seed=32, layers=2, **SMALL)),
        # transformers saves MoE experts one tensor per expert; the model fuses them.
        "moe": str(
            make_checkpoint(
                root / "moe", "qwen3_moe", tie=True, seed=33, num_experts=5, max_shard_size="30KB"
            )
        ),
    }


def _check_tied_run(res: list[dict], meta_everywhere: bool) -> None:
    assert all(r["tied"] for r in res)
    for r in res[1:]:  # what verl's apply_fsdp2 was handed on ranks >= 1
        assert r["seen"]["meta"] is meta_everywhere and r["seen"]["tied_before"] is not meta_everywhere
    assert res[0]["seen"] == {"meta": False, "tied_before": True}


@pytest.mark.parametrize("meta_everywhere", [False, True], ids=["guard_kept", "meta_everywhere"])
def test_engine_tied_bit_exact(group2: RankGroup, ckpts, meta_everywhere: bool) -> None:
    res = group2.run(
        cases.case_engine_bit_exact, ckpt=ckpts["tied"], dtype=torch.float32, meta_everywhere=meta_everywhere
    )
    _check_tied_run(res, meta_everywhere)


def test_meta_everywhere_without_tie_weights_is_tie_error(group2: RankGroup, ckpts) -> None:
    res = group2.run(cases.case_meta_untied, ckpt=ckpts["tied"], dtype=torch.float32, timeout=120)
    for r in res:
        assert r["error"] is not None and r["tensor"] == "lm_head.weight" and r["strategies"] == 0, r
        assert "group ranks [1] of 2" in r["error"] and "tie_weights()" in r["error"], r["error"]
    assert res[1]["seen"] == {"meta": True, "tied_before": False}


def test_without_the_check_ranks_shard_different_parameters(group2: RankGroup, ckpts) -> None:
    # The check disabled: the load "succeeds" and the head looks tied on every rank, yet FSDP
    # manages lm_head.weight on its own on rank 1 only (the first forward would all-gather
    # different sizes). This is what the TieError above stands for.
    res = group2.run(
        cases.case_meta_untied, ckpt=ckpts["tied"], dtype=torch.float32, check=False, timeout=120
    )
    assert all(r["error"] is None and r["tied"] for r in res)
    groups = res[0]["groups"]
    assert ("", ("lm_head.weight", "model.embed_tokens.weight")) in groups[0]
    assert ("", ("lm_head.weight",)) in groups[1] and groups[0] != groups[1]


def test_untied_alias_on_every_rank_and_different_wrapping(group2: RankGroup, ckpts) -> None:
    for r in group2.run(cases.case_plain_untied_everywhere, ckpt=ckpts["tied"]):
        assert r["tensor"] == "lm_head.weight" and "group ranks [0, 1] of 2" in r["error"], r
    for r in group2.run(cases.case_wrap_differs, ckpt=ckpts["tied"]):
        assert r["error"] and "different parameters" in r["error"] and r["tensor"] == "model.norm.weight", r


def test_buffers_kwarg(group2: RankGroup, ckpts) -> None:
    res = group2.run(cases.case_buffers_kwarg, ckpt=ckpts["tied"], dtype=torch.float32)
    want = torch.arange(3, dtype=torch.float32) * 0.125 + 1.0
    for r in res:
        assert all(torch.equal(v, want) for v in r["values"]), r
    for bad, error in (
        ("name", "KeyMismatchError"),
        ("shape", "ShapeMismatchError"),
        ("dtype", "DTypeMismatchError"),
    ):
        res = group2.run(
            cases.case_buffers_kwarg, ckpt=ckpts["tied"], dtype=torch.float32, bad=bad, timeout=120
        )
        assert [r["error"] for r in res] == [error, error] and all(r["strategies"] == 0 for r in res), res


def test_cpu_offload(group2: RankGroup, ckpts) -> None:
    for r in group2.run(cases.case_pinning_needs_accelerator):
        assert r.get("skipped") or (r["raised"] and not r["pinned"] and r["sharded"].startswith("FSDP")), r
    res = group2.run(
        cases.case_engine_bit_exact,
        ckpt=ckpts["tied"],
        dtype=torch.float32,
        meta_everywhere=True,
        offload=True,
    )
    _check_tied_run(res, True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("meta_everywhere", [False, True], ids=["guard_kept", "meta_everywhere"])
def test_engine_4_ranks(group4: RankGroup, ckpts, dtype: torch.dtype, meta_everywhere: bool) -> None:
    res = group4.run(
        cases.case_engine_bit_exact,
        ckpt=ckpts["tied"],
        dtype=dtype,
        meta_everywhere=meta_everywhere,
        timeout=240,
    )
    _check_tied_run(res, meta_everywhere)


@pytest.mark.slow
def test_engine_4_ranks_untied_offload_and_tie_error(group4: RankGroup, ckpts) -> None:
    res = group4.run(
        cases.case_engine_bit_exact,
        ckpt=ckpts["untied"],
        dtype=torch.float32,
        meta_everywhere=False,
        offload=True,
    )
    assert not any(r["tied"] for r in res)
    res = group4.run(cases.case_meta_untied, ckpt=ckpts["tied"], dtype=torch.float32, timeout=120)
    assert all(r["tensor"] == "lm_head.weight" and "group ranks [1, 2, 3] of 4" in r["error"] for r in res), (
        res
    )


@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("meta_everywhere", [False, True], ids=["guard_kept", "meta_everywhere"])
def test_engine_moe_per_expert(
    group2: RankGroup, group4: RankGroup, ckpts, ws: int, meta_everywhere: bool
) -> None:
    group = group2 if ws == 2 else group4
    res = group.run(
        cases.case_engine_bit_exact,
        ckpt=ckpts["moe"],
        dtype=torch.float32,
        meta_everywhere=meta_everywhere,
        timeout=240,
    )
    _check_tied_run(res, meta_everywhere)


@pytest.mark.slow
def test_engine_3_ranks_uneven() -> None:
    # An odd world: FSDP's Shard(0) pads every dim-0 shard unevenly (97-row vocabulary, 24-wide layers).
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        ckpt = str(make_checkpoint(f"{root}/tied", "qwen2", tie=True, seed=34, layers=2, **SMALL))
        group = RankGroup(3)
        try:
            for meta_everywhere in (False, True):
                res = group.run(
                    cases.case_engine_bit_exact,
                    ckpt=ckpt,
                    dtype=torch.float32,
                    meta_everywhere=meta_everywhere,
                    timeout=240,
                )
                _check_tied_run(res, meta_everywhere)
            res = group.run(cases.case_meta_untied, ckpt=ckpt, dtype=torch.float32, timeout=120)
            assert all("group ranks [1, 2] of 3" in r["error"] for r in res), res
        finally:
            group.close()
