"""Missing tensors initialised without DTensor random ops (issue #43 item 6), with real
gloo ranks: the construction (plain CPU stand-ins, one seed for all ranks) and a
strict=False load over part of the world. The CUDA half is in tests/test_gpu.py."""

from __future__ import annotations

import shutil

import cases_missing_init as cases
import pytest
import torch
from rank_group import RankGroup
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from streamload.io.copy_ops import bit_view
from streamload.model.missing import SENTINEL, fill_uncovered, plain_tensors
from streamload.tools.synthetic import make_checkpoint

WORLD = 3
# Linear weights transformers initialises with normal_ (a random op), a norm with ones_.
MISSING = [
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.norm.weight",
]


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("missing_init")
    full = make_checkpoint(
        root / "full",
        "qwen2",
        tie=True,
        seed=5,
        layers=2,
        vocab=64,
        hidden_size=32,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    holes = root / "holes"
    shutil.copytree(full, holes)
    sd = load_file(str(holes / "model.safetensors"))
    for name in MISSING:
        del sd[name]
    save_file(sd, str(holes / "model.safetensors"), metadata={"format": "pt"})
    return str(holes)


def test_subgroup_load_with_missing_weights_runs_no_rng_tracker_nor_collective(
    group: RankGroup, ckpt: str
) -> None:
    """On ranks [0, ws) of 3, each seeded differently, the CPU mesh looking RNG-capable to torch:
    no tracker is created, fill_uncovered calls no collective, and every world size loads the
    same values (those of rank 0's seed), leaving each rank's RNG as it was."""
    runs = {ws: group.run(cases.case_missing_init, ckpt=ckpt, ws=ws, missing=MISSING) for ws in (2, 3, 1)}
    want = runs[1][0]["values"]
    for ws, res in runs.items():
        for r in res[:ws]:
            assert r["missing"] == sorted(MISSING), r["missing"]
            assert r["trackers"] == [], (ws, r["trackers"])
            assert r["collectives"] == [], (ws, r["collectives"])
            assert r["rng_kept"], ws
            for name, value in want.items():
                assert torch.equal(bit_view(r["values"][name]), bit_view(value)), (ws, name)
        assert all(r is None for r in res[ws:])
    head = want["model.layers.0.mlp.down_proj.weight"].float()
    assert 0.005 < float(head.std()) < 0.05  # transformers' normal_(0, initializer_range=0.02)
    assert torch.equal(want["model.norm.weight"], torch.ones_like(want["model.norm.weight"]))


class _Spy(nn.Module):
    """Records what its initialiser is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)
        self.seen: list[tuple[str, str, bool]] = []

    def _init_weights(self, module: nn.Module) -> None:
        for sub in module.modules():
            for name, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
                self.seen.append((name, t.device.type, isinstance(t, DTensor)))
        if isinstance(module, nn.Linear):
            module.weight.data.normal_()  # through .data: no version bump, the bytes tell


def test_the_initialiser_sees_plain_tensors_only() -> None:
    """The construction: stand-ins of the global shape, the missing ones on the CPU, the rest on
    meta; none is a DTensor; the originals come back; the seed alone decides the values."""
    net = _Spy()
    original = net.a.weight
    with plain_tensors(net.a, ["weight"]) as fresh:
        assert fresh["weight"].device.type == "cpu" and fresh["weight"].shape == (6, 4)
        assert bool((fresh["weight"].view(torch.uint8) == SENTINEL).all())
        assert net.a.bias.device.type == "meta" and net.a.bias._is_hf_initialized  # type: ignore[attr-defined]
    assert net.a.weight is original
    values = []
    for _ in range(2):
        net.seen.clear()
        torch.manual_seed(torch.seed())  # the caller's RNG moves: the seed given decides
        fill_uncovered(net, ["a.weight"], {}, seed=77)
        values.append(net.a.weight.detach().clone())
        assert net.seen == [("weight", "cpu", False), ("bias", "meta", False)], net.seen
    assert torch.equal(values[0], values[1])
    expect = torch.empty(6, 4)
    expect.normal_(generator=torch.Generator().manual_seed(77))
    assert torch.equal(values[0], expect)  # a non-sharded init drawing from that seed
