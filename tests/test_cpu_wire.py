"""A plain CPU model under an NCCL-only default group (a CPU reference model under torchrun):
NCCL refuses CPU tensors on every rank, so the load runs over a gloo group of the same ranks,
made for it and destroyed with it; over part of such a world it is refused with a named error.
Faked on gloo ranks (cases_cpu_wire.nccl_only), at 2 and 3 ranks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import cases_cpu_wire as cases
import pytest
from rank_group import RankGroup

from streamload.tools.synthetic import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("cpu_wire")
    return str(
        make_checkpoint(
            root / "tied",
            "qwen2",
            tie=True,
            seed=43,
            layers=2,
            vocab=61,
            hidden_size=24,
            intermediate_size=38,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_shard_size="8KB",
        )
    )


@pytest.fixture(scope="module")
def group3() -> Iterator[RankGroup]:
    g = RankGroup(3)
    yield g
    g.close()


@pytest.fixture
def groups(request: pytest.FixtureRequest) -> dict[int, RankGroup]:
    return {2: request.getfixturevalue("group2"), 3: request.getfixturevalue("group3")}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("readers", ["src", "owners"])
def test_cpu_model_under_nccl_loads_over_a_gloo_group(
    groups: dict[int, RankGroup], ckpt: str, world: int, readers: str
) -> None:
    res = groups[world].run(cases.case_cpu_model_under_nccl, ckpt=ckpt, readers=readers)
    for r in res:
        assert r["results"] == ["loaded", readers] * 2, r
        assert r["seen"]["nccl"] == 0 and r["seen"]["gloo"] > 0, r  # nothing tried on the NCCL group
        assert r["groups"] == 0, r  # each load's gloo group destroyed with it


def test_cpu_model_under_part_of_an_nccl_world_is_refused_by_name(
    groups: dict[int, RankGroup], ckpt: str
) -> None:
    res = groups[3].run(cases.case_cpu_model_under_nccl_subgroup, ckpt=ckpt)
    assert res[2] == {"outside": True}
    for r in res[:2]:
        assert r["outcome"].startswith("PlacementError"), r
        assert "carries no CPU tensors" in r["outcome"] and "backend='gloo'" in r["outcome"], r
        assert r["seen"] == {"nccl": 0, "gloo": 0}, r  # refused before any collective


def test_a_device_wire_keeps_its_group(groups: dict[int, RankGroup]) -> None:
    assert groups[2].run(cases.case_cuda_wire_unchanged) == [{"same": True, "owned": False}] * 2


@pytest.mark.parametrize("world", [2, 3])
def test_cpu_model_saved_under_nccl_over_a_gloo_group(
    groups: dict[int, RankGroup], ckpt: str, world: int, tmp_path: Path
) -> None:
    """The save of such a model: agreements and the src writer's exchange on the gloo twin, the
    files transformers' own save of the same model."""
    import warnings

    from transformers import AutoModelForCausalLM

    res = groups[world].run(cases.case_cpu_model_saved_under_nccl, ckpt=ckpt, out=str(tmp_path / "out"))
    for r in res:
        assert r["results"] == ["owners", "src"], r
        assert r["seen"]["nccl"] == 0 and r["seen"]["gloo"] > 0 and r["groups"] == 0, r
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(tmp_path / "ref", max_shard_size="8KB")
    ref = {p.name: p.read_bytes() for p in (tmp_path / "ref").glob("*.safetensors*")}
    for w in ("owners", "src"):
        got = {p.name: p.read_bytes() for p in (tmp_path / f"out-{w}").glob("*.safetensors*")}
        assert got == ref, w
