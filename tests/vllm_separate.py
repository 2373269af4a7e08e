"""The separate-engine cases: one vLLM engine in a process of its own (``engine_main``, started by
vllm_run.py with the vLLM venv's interpreter), fed by the trainer ranks of rank_group.py through
``streamload.RemoteEngine`` / ``EngineServer``. The trainer models and the fresh engines of their
saves are the colocated cases' (vllm_cases: already one optimizer step on), so the separate engine
is held to exactly what a fresh engine of ``save_pretrained`` of the trained model gives.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import psutil
import torch.distributed as dist
import vllm_cases as cases

import streamload

HOST = "127.0.0.1"


def engine_state(llm: Any) -> tuple[dict[str, Any], Any]:
    """Runs in the engine's process: its tensors read back through the engine, and its greedy
    tokens + logprobs of the fixed prompts."""
    return llm.collective_rpc(cases.worker_readback)[0], cases.generate(llm)


def engine_main(ckpts: dict[str, str], ports: dict[str, int], trainers: int) -> None:
    """The engine process: one engine per model (MoE first), each served until its link closes."""
    llms = {key: cases.engine(ckpts[key], key) for key in ckpts}
    print("engines up", file=sys.stderr, flush=True)
    for key, llm in llms.items():
        streamload.EngineServer(llm, HOST, ports[key], trainers, timeout=120).serve(idle=300)
    time.sleep(600)  # the last link stays open until the trainers kill this process


def case_separate(rank: int, world: int, *, ports: dict[str, int], engine_pid: int) -> dict[str, Any]:
    """Each model's engine in the engine process, synced by every trainer rank, equals a fresh
    engine of the save; five syncs flat on both sides; a mismatch and a dead engine named on
    every rank."""
    out: dict[str, Any] = {}
    keys = list(ports)
    remote = None
    for key in keys:
        model = cases._MODELS[key]
        want_w, want_g, fresh_spread = cases._WANT[key]
        t0 = time.perf_counter()
        remote = streamload.RemoteEngine(HOST, ports[key], timeout=120)
        r: dict[str, Any] = {"connect_seconds": time.perf_counter() - t0, "fresh_spread": fresh_spread}
        if key == "dense_tied":
            try:
                streamload.sync_weights(cases._MODELS["dense_untied"], remote)
            except streamload.EngineMismatchError as exc:
                r["mismatch"] = (type(exc).__name__, exc.rank, len(exc.unexpected), len(exc.missing))
        r["report"] = streamload.sync_weights(model, remote)
        state = remote.call(engine_state)
        if state is not None:  # rank 0
            r["diff"] = cases._diff(state[0], want_w)
            r["readback"] = len(state[0])
            r["tokens_equal"] = [t for t, _ in state[1]] == [t for t, _ in want_g]
            r["spread"] = cases._spread(state[1], want_g)
        rss, engine_rss = [], []
        for _ in range(5):
            rep = streamload.sync_weights(model, remote)
            rss.append(cases._rss())
            engine_rss.append(rep.engine_rss)
        r["five_rss"], r["five_engine_rss"] = rss, engine_rss
        state = remote.call(engine_state)
        if state is not None:
            r["after_five_diff"] = cases._diff(state[0], want_w)
            r["after_five_spread"] = cases._spread(state[1], want_g)
        out[key] = r
        if key != keys[-1]:
            remote.close()
    # The engine process dies (SIGKILL) in the middle of a transfer: rank 0 kills it just before it
    # packs the second layer group, with every rank inside the pass's per-group reduces. Every rank
    # names it, within a bounded time; the next sync (the engine dead between syncs) names it too.
    assert remote is not None
    from streamload.sync.source import HubSource

    real = HubSource._materialise

    def killing(self: HubSource, g: Any) -> Any:
        if g.index == 1:
            os.kill(engine_pid, signal.SIGKILL)
            while (
                psutil.pid_exists(engine_pid) and psutil.Process(engine_pid).status() != psutil.STATUS_ZOMBIE
            ):
                time.sleep(0.05)
        return real(self, g)

    dist.barrier()
    if rank == 0:
        HubSource._materialise = killing  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        streamload.sync_weights(cases._MODELS[keys[-1]], remote, timeout=60)
    except streamload.EngineDeadError as exc:
        out["dead_mid"] = (type(exc).__name__, exc.rank, str(exc), time.perf_counter() - t0)
    finally:
        HubSource._materialise = real  # type: ignore[method-assign]
    try:
        streamload.sync_weights(cases._MODELS[keys[-1]], remote)
    except streamload.EngineDeadError as exc:
        out["dead"] = (type(exc).__name__, exc.rank, str(exc))
    return out
