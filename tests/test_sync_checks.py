"""The sync's checks that need no engine: the engine's expected hub tensors from its config,
a mismatch named with its lists, tie aliases from the engine's module tree."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from streamload import EngineMismatchError
from streamload.save.layout import output_layout
from streamload.sync.driver import check_engine
from streamload.sync.vllm_engine import tie_aliases
from streamload.tools.synthetic import make_config


def _model(**kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(make_config("qwen3_moe", **{"tie": True, "num_experts": 3, **kw}))


def test_engine_of_the_same_config_passes() -> None:
    m = _model()
    check_engine(output_layout(m), m.config.to_dict())


def test_engine_shapes_and_names_that_differ_are_named() -> None:
    trainer = _model()
    engine = _model(moe_intermediate_size=24, num_experts=4).config.to_dict()
    with pytest.raises(EngineMismatchError) as info:
        check_engine(output_layout(trainer), engine, rank=1)
    e = info.value
    assert e.rank == 1 and "rank 1" in str(e)
    assert e.missing and all(".experts.3." in k for k in e.missing)  # the engine's fourth expert
    assert not e.unexpected
    assert e.shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == ((32, 16), (32, 24))


def test_tie_aliases_keep_only_names_the_hub_lacks() -> None:
    ties = [
        ["lm_head.weight", "model.embed_tokens.weight"],
        ["model.a.weight", "model.b.weight"],  # none of them sent: nothing to alias
    ]
    hub = ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"]
    assert tie_aliases(ties, hub) == {"model.embed_tokens.weight": ["lm_head.weight"]}


# -- faults: never a hang (issue #42) ------------------------------------------------------------
# A plain engine (tests/cases_sync_faults.py: a transformers model behind collective_rpc and
# reload_weights) colocated on each of 3 trainer ranks, or alone in a process of its own behind
# EngineServer. Each fault below hung the trainer ranks before (a dead engine's reduce waited in
# 1 s slices for ever: gloo's own timeout was taken for the slice's; a rank that failed between
# two per-group collectives left its peers in the next one; an engine call's error reached rank 0
# only).


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import cases_sync_faults as cases
    from rank_group import RankGroup

    from streamload.tools.synthetic import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("sync_faults"), "llama", dtype=torch.float32, seed=5))
    engine, port = _engine_process(ckpt, 3, die_on=4)
    g = RankGroup(3)
    try:
        out = {"remote": g.run(cases.case_remote, timeout=90, ckpt=ckpt, port=port)}
        out["colocated"] = g.run(cases.case_colocated, timeout=90, ckpt=ckpt)
    finally:
        g.close(kill=True)
        engine.kill()
        _, err = engine.communicate(timeout=10)
    out["engine_rc"], out["engine_log"] = engine.returncode, err
    return out


def test_engine_killed_mid_transfer_is_named_on_every_rank(faults: dict[str, Any]) -> None:
    assert faults["engine_rc"] == -signal.SIGKILL and "SIGKILL mid-transfer" in faults["engine_log"]
    for rank, r in enumerate(faults["remote"]):
        assert r["first"]["raised"] is None and r["after"]["raised"] is None, r
        k = r["killed"]
        assert k["raised"] == "EngineDeadError", (rank, k)
        # the process's death is noticed within a second or two (a ping between wait slices),
        # far inside the sync's timeout=20
        assert k["seconds"] < 10, (rank, k)
        assert r["call_dead"]["raised"] == "EngineDeadError", (rank, r["call_dead"])
    seconds = [round(r["killed"]["seconds"], 2) for r in faults["remote"]]
    print(f"engine SIGKILLed mid-transfer: EngineDeadError after {seconds} s (ranks 0..2)", file=sys.stderr)


def test_trainer_rank_failing_to_pack_a_group_is_named_on_every_rank(faults: dict[str, Any]) -> None:
    for kind in ("remote", "colocated"):
        for rank, r in enumerate(faults[kind]):
            p = r["pack"]
            assert p["raised"] == "SyncError" and p["rank"] == 1, (kind, rank, p)
            assert (p["tensor"] or "").startswith("model.layers.1.") and "packing layer group" in p[
                "message"
            ], p
            assert p["seconds"] < 10, (kind, rank, p)
            assert r["after"]["raised"] is None, (kind, rank, r["after"])  # the next sync is whole
    assert faults["remote"][0]["equal"] is True  # the engine, synced again, holds the trainer's weights
    assert all(r["equal"] for r in faults["colocated"])


def test_engine_reload_failing_mid_pass_is_named_on_every_rank(faults: dict[str, Any]) -> None:
    for rank, r in enumerate(faults["colocated"]):
        f = r["reload"]
        assert f["raised"] == "SyncError" and f["rank"] == 1, (rank, f)
        assert "injected reload failure" in f["message"], (rank, f)


def test_engine_call_that_raises_is_named_on_every_rank(faults: dict[str, Any]) -> None:
    for rank, r in enumerate(faults["remote"]):
        c = r["call"]
        assert c["raised"] == "SyncError" and "injected call failure" in c["message"], (rank, c)


def _engine_process(
    ckpt: str, trainers: int, die_on: int = 0, **env_extra: str
) -> tuple[subprocess.Popen, int]:
    import cases_sync_faults as cases

    with socket.socket() as s:
        s.bind((cases.HOST, 0))
        port = s.getsockname()[1]
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env_extra}
    cmd = [sys.executable, cases.__file__, ckpt, str(port), str(trainers), str(die_on)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), port


@pytest.mark.slow
@pytest.mark.parametrize("where", ["colocated", "remote"])
def test_trainer_rank_killed_mid_pass_is_named(tmp_path: Path, where: str) -> None:
    import cases_sync_faults as cases
    from rank_group import RankGroup
    from test_arrival import _run_partial

    from streamload.tools.synthetic import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path / "ckpt", "llama", dtype=torch.float32, seed=5))
    engine, port = _engine_process(ckpt, 3) if where == "remote" else (None, None)
    g = RankGroup(3)
    try:
        out = _run_partial(g, cases.case_trainer_killed, [0, 1], 90, ckpt=ckpt, port=port)
    finally:
        g.close(kill=True)
        if engine is not None:
            engine.kill()
            engine.communicate(timeout=10)
    print(f"{where}: rank 2 SIGKILLed mid-pass: {out}", file=sys.stderr)
    for rank, r in out.items():
        assert r["raised"] == "RankLostError" and r["ranks"] == [2], (rank, r)
        assert r["seconds"] < 20, (rank, r)


@pytest.mark.slow
def test_engine_stopped_mid_transfer_is_bounded(tmp_path: Path) -> None:
    import cases_sync_faults as cases
    from rank_group import RankGroup

    from streamload.tools.synthetic import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path / "ckpt", "llama", dtype=torch.float32, seed=5))
    engine, port = _engine_process(ckpt, 3, die_on=2, ENGINE_STOPS="1")
    g = RankGroup(3)
    try:
        out = g.run(cases.case_engine_stopped, timeout=90, ckpt=ckpt, port=port)
    finally:
        g.close(kill=True)
        engine.kill()
        engine.communicate(timeout=10)
    print(
        f"engine SIGSTOPped mid-transfer: {[(r['raised'], round(r['seconds'], 1)) for r in out]}",
        file=sys.stderr,
    )
    for rank, r in enumerate(out):
        assert r["raised"] == "EngineDeadError" and "does not answer" in r["message"], (rank, r)
        assert r["seconds"] < 20, (rank, r)


def test_a_collective_waits_at_most_the_syncs_timeout(faults: dict[str, Any]) -> None:
    # rank 1's engine stalls 8 s mid-pass (alive, not pulling); sync timeout=3
    for rank, r in enumerate(faults["colocated"]):
        s = r["stall"]
        assert s["raised"] == "RankLostError", (rank, s)
        assert s["seconds"] < 3 + 3 + 8, (rank, s)  # the deadline, the roll call's wait, the stall
    print(f"a stalled engine: {[(r['stall']['raised'], round(r['stall']['seconds'], 1)) for r in faults['colocated']]}",
          file=sys.stderr)  # fmt: skip


def test_an_engine_of_another_link_protocol_is_refused() -> None:
    """The trainer and the engine must read the group buffers' flag words alike: an engine that
    posts another link protocol (an older streamload: none) is refused before the transfer group."""
    import torch.distributed as dist

    from streamload import SyncError
    from streamload.sync import remote

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    remote._put(store, remote._PREFIX + "info", {"trainers": 1})
    with pytest.raises(SyncError, match=f"link protocol 1, this trainer {remote.PROTOCOL}"):
        remote.RemoteEngine("127.0.0.1", store.port, timeout=5)
