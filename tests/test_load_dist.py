"""Streaming into FSDP2 shards with real gloo ranks: bit-exact against
transformers' from_pretrained, ties, buffers, placements, strict keys."""

from __future__ import annotations

import shutil
from pathlib import Path

import cases_load as cases
import pytest
import torch
from rank_group import CaseError, RankGroup
from safetensors.torch import load_file, save_file

from streamload.tools.synthetic import make_checkpoint

WORLD = 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    # Odd sizes so every world size shards unevenly; small shards so files are many.
    common = dict(
        layers=2,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_shard_size="8KB",
    )
    out["tied"] = str(make_checkpoint(root / "tied", "qwen2", tie=True, seed=1, **common))
    out["untied"] = str(make_checkpoint(root / "untied", "qwen2", tie=False, seed=2, **common))
    out["tied_f32"] = str(
        make_checkpoint(root / "tied_f32", "qwen2", tie=True, seed=4, dtype=torch.float32, **common)
    )
    out["llama_f32"] = str(
        make_checkpoint(root / "llama", "llama", tie=False, seed=3, dtype=torch.float32, **common)
    )
    tiny = root / "tiny"
    tiny.mkdir()
    save_file(cases.tiny_state(), str(tiny / "model.safetensors"))
    out["tiny"] = str(tiny)
    # A checkpoint with one key missing and one unexpected.
    bad = root / "bad_keys"
    shutil.copytree(out["untied"], bad)
    files = sorted(bad.glob("*.safetensors"))
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
        f.unlink()
    (bad / "model.safetensors.index.json").unlink()
    sd.pop("model.norm.weight")
    sd["model.extra.weight"] = torch.zeros(3)
    save_file(sd, str(bad / "model.safetensors"))
    out["bad_keys"] = str(bad)
    return out


@pytest.fixture(scope="module")
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_from_pretrained_matches_transformers(group: RankGroup, ckpts, ws: int) -> None:
    for name in ("tied", "untied", "llama_f32"):
        for dtype in (None, torch.float32, torch.bfloat16):
            res = group.run(cases.case_from_pretrained, ckpt=ckpts[name], ws=ws, dtype=dtype)
            rep = res[0]["report"]
            assert res[0]["tied"] == (name == "tied") or name != "tied"
            assert rep["buckets"] > 1
            assert sum(rep["bytes_received"]) == rep["payload_bytes"]
            if name == "tied":
                assert ["model.embed_tokens.weight", "lm_head.weight"] in rep["tie_groups"]
            if ws > 1:
                assert rep["bytes_sent"] > 0 and rep["bytes_received"][1] > 0
            # Only the reader reads (or maps, where its shard is a run of the file in its dtype).
            assert rep["bytes_read"] + rep["bytes_mapped"] > 0
            # The default map_files="auto" copies trainable parameters (a first optimizer step
            # would pay a copy-on-write fault per mapped page); map_files=True maps them.
            assert rep["bytes_mapped"] == 0


def test_fp32_masters_from_bf16_file_narrow_on_sender(group: RankGroup, ckpts) -> None:
    res = group.run(cases.case_from_pretrained, ckpt=ckpts["llama_f32"], ws=3, dtype=torch.bfloat16)
    rep = res[0]["report"]
    # f32 file -> bf16 params: the wire carries bf16, half of what was read.
    assert rep["payload_bytes"] * 2 == rep["bytes_read"]


@pytest.mark.parametrize("ws,shard_dim", [(2, 1), (3, 1), (3, 0), (4, 1)])
def test_meta_model_and_shard_placement(group: RankGroup, ckpts, ws: int, shard_dim: int) -> None:
    for name in ("tied", "untied"):
        group.run(cases.case_load_meta_model, ckpt=ckpts[name], ws=ws, shard_dim=shard_dim)


def test_hsdp_2x2(group: RankGroup, ckpts) -> None:
    for name in ("tied", "untied"):
        res = group.run(cases.case_from_pretrained, ckpt=ckpts[name], ws=4, hsdp=True)
        assert res[0]["report"]["bytes_received"][0] == res[0]["report"]["bytes_received"][2]


@pytest.mark.parametrize("ws", [1, 3, 4])
@pytest.mark.parametrize("shard", [True, False])
def test_plain_module_uneven_and_unmanaged(group: RankGroup, ckpts, ws: int, shard: bool) -> None:
    res = group.run(cases.case_plain_module, ckpt=ckpts["tiny"], ws=ws, shard=shard)
    if shard and ws >= 3:
        # proj.weight has 2 rows: some rank holds none of it, yet everything matches.
        assert min(res[0]["bytes_received"]) < max(res[0]["bytes_received"])


@pytest.mark.parametrize("ws", [2, 3])
def test_tied_gradient_matches_single_process(group: RankGroup, ckpts, ws: int) -> None:
    res = group.run(cases.case_tied_gradient, ckpt=ckpts["tied"], ws=ws)
    assert res[0]["untied_diff"] > 100 * max(res[0]["max_diff"], 1e-9)


@pytest.mark.parametrize("ws", [1, 3])
def test_training_steps_on_mapped_shards(group: RankGroup, ckpts, ws: int) -> None:
    """Mapped shards (owners read float32 files into float32 parameters) and
    private copies train the same; the checkpoint files stay byte-identical."""
    for readers, map_files in (("owners", True), ("owners", False), ("src", True)):
        res = group.run(
            cases.case_train_steps, ckpt=ckpts["tied_f32"], ws=ws, readers=readers, map_files=map_files
        )
        mapped = [r["bytes_mapped"] for r in res[:ws]]
        if map_files and (readers == "owners" or ws == 1):
            assert all(m > 0 for m in mapped), mapped
        elif map_files:
            assert mapped[0] > 0 and not any(mapped[1:]), mapped  # only the reader maps
        else:
            assert not any(mapped), mapped


def test_strict_keys_raise_on_every_rank(group: RankGroup, ckpts) -> None:
    res = group.run(cases.case_strict_keys, ckpt=ckpts["bad_keys"], ws=3, strict=True)
    for r in res[:3]:
        assert r["raised"] == "KeyMismatchError"
        assert r["missing"] == ["model.norm.weight"] and r["unexpected"] == ["model.extra.weight"]
    res = group.run(cases.case_strict_keys, ckpt=ckpts["bad_keys"], ws=3, strict=False)
    assert res[1] == {"raised": None, "missing": ["model.norm.weight"], "unexpected": ["model.extra.weight"]}


def test_harness_reports_failures(group: RankGroup, ckpts) -> None:
    with pytest.raises(CaseError, match="failed on ranks"):
        group.run(cases.case_from_pretrained, ckpt=str(Path(ckpts["tiny"]) / "nope"), ws=2)


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_reader_modes(group: RankGroup, ckpts, ws: int) -> None:
    for name in ("tied", "untied"):
        for readers, all_see, want in [
            ("owners", True, "owners"),
            ("auto", True, "owners"),
            ("src", True, "src"),
            ("auto", False, "src"),
        ]:
            res = group.run(
                cases.case_from_pretrained,
                ckpt=ckpts[name],
                ws=ws,
                readers=readers,
                all_see=all_see,
                dtype=torch.float32,
            )
            reps = [r["report"] for r in res[:ws]]
            assert all(r["reader"].startswith(want) for r in reps), (readers, reps[0]["reader"])
            if want == "owners":
                # No transport, and each byte of a sharded parameter is read exactly once across ranks.
                assert all(r["bytes_sent"] == 0 for r in reps)
                assert (
                    sum(r["bytes_read"] + r["bytes_mapped"] for r in reps) == reps[0]["payload_bytes"]
                )  # bf16 on the wire and read
            else:
                assert reps[0]["bytes_read"] > 0 and all(r["bytes_read"] == 0 for r in reps[1:])


def test_node_readers_keep_traffic_inside_each_node(group: RankGroup, ckpts) -> None:
    # Two simulated nodes of two ranks; the first rank of each sees the files.
    for readers in ("node", "auto"):
        res = group.run(cases.case_from_pretrained, ckpt=ckpts["untied"], ws=4, readers=readers, nodes=2)
        reps = [r["report"] for r in res]
        assert all(r["reader"].startswith("node") for r in reps), reps[0]["reader"]
        assert reps[1]["bytes_read"] == reps[3]["bytes_read"] == 0
        # Each node's reader read (or mapped, its own) exactly its own node's shards.
        received = reps[0]["bytes_received"]
        assert reps[0]["bytes_read"] + reps[0]["bytes_mapped"] == received[0] + received[1]
        assert reps[2]["bytes_read"] + reps[2]["bytes_mapped"] == received[2] + received[3]
        assert reps[0]["bytes_sent"] == received[1] + received[3]  # only within nodes


def test_node_mode_repeated_loads_keep_the_process_group_count(group: RankGroup, ckpts) -> None:
    # Five node-mode loads in one process group: each load's node groups are
    # destroyed with its reader strategy, so torch's group table does not grow.
    res = group.run(cases.case_node_repeated_loads, ckpt=ckpts["untied"], ws=4, loads=5)
    for r in res:
        assert all(reader.startswith("node") for reader in r["readers"]), r["readers"]
        assert len(r["counts"]) == 5
        assert r["counts"] == [r["before"]] * 5, (r["before"], r["counts"])
