"""Faults in a weight sync, with no vLLM: a plain engine (``PlainLLM``, a transformers model behind
the two calls of vLLM's that the sync makes: ``collective_rpc`` and the worker's
``reload_weights``), colocated on each trainer rank or alone in a process of its own behind
``EngineServer`` (``python tests/cases_sync_faults.py ...`` is that process). The trainer cases run
inside rank_group.py's ranks.

Faults are real: the engine process SIGKILLs itself in the middle of a transfer (the trainer ranks
are in the per-group reduces), a trainer rank's packing of a group raises, an engine's reload
raises, an engine call raises.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

import streamload
import streamload.sync.source as sync_source

HOST = "127.0.0.1"
FAULTY = "model.layers.1."
STALL_SECONDS = 8.0  # an engine stuck this long, against a sync's timeout=3  # the layer group faults hit (group 2 of 4: the pass is under way)


class PlainWorker:
    """What the sync's worker functions use of a vLLM worker: the model, its config, a reload.

    Args:
        model: the engine's model (hub names are its parameter names).
        die_on: SIGKILL this process when the ``die_on``-th reload reaches ``FAULTY`` (0: never).
        fail_on: raise in the ``fail_on``-th reload when it reaches ``FAULTY`` (0: never).
        stall_on: sleep ``STALL_SECONDS`` in the ``stall_on``-th reload at ``FAULTY`` (0: never).
    """

    def __init__(self, model: torch.nn.Module, die_on: int = 0, fail_on: int = 0, stall_on: int = 0) -> None:
        self.model = model
        self.model_runner = self
        self.model_config = SimpleNamespace(hf_config=model.config)
        self.device = torch.device("cpu")
        self.die_on, self.fail_on, self.stall_on, self.reloads = die_on, fail_on, stall_on, 0

    def get_model(self) -> torch.nn.Module:
        return self.model

    def reload_weights(self, weights_iterator: Any) -> None:
        self.reloads += 1
        params = dict(self.model.named_parameters())
        for name, t in weights_iterator:
            if name.startswith(FAULTY) and self.reloads == self.die_on:
                how = signal.SIGSTOP if os.environ.get("ENGINE_STOPS") else signal.SIGKILL
                print(f"engine {os.getpid()}: {how.name} mid-transfer", file=sys.stderr, flush=True)
                os.kill(os.getpid(), how)
            if name.startswith(FAULTY) and self.reloads == self.stall_on:
                time.sleep(STALL_SECONDS)
                self.stall_on = 0
            if name.startswith(FAULTY) and self.reloads == self.fail_on:
                raise RuntimeError(f"injected reload failure at {name}")
            with torch.no_grad():
                params[name].copy_(t)


class PlainLLM:
    """``vllm.LLM``'s ``collective_rpc`` over one ``PlainWorker``."""

    def __init__(self, worker: PlainWorker) -> None:
        self.worker = worker

    def collective_rpc(self, fn: Any, args: tuple = ()) -> list[Any]:
        return [fn(self.worker, *args)]


def _engine_model(ckpt: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)


def checksum(llm: PlainLLM) -> float:
    """Runs in the engine's process (``RemoteEngine.call``): a sum over its weights."""
    return float(sum(p.double().sum() for p in llm.worker.model.parameters()))


def fails(llm: PlainLLM) -> None:
    """Runs in the engine's process: a call that raises."""
    raise ValueError("injected call failure")


def _model(ckpt: str, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return streamload.from_pretrained(ckpt, device_mesh=mesh, dtype=torch.float32, progress=False)


def _trainer_sum(model: torch.nn.Module) -> float:
    return float(sum(p.full_tensor().double().sum() for p in model.parameters()))


def _pack_fails_on(rank: int, on_rank: int) -> Any:
    """Makes ``on_rank``'s packing of ``FAULTY``'s group raise; returns the undo."""
    real = sync_source._region

    def region(slot: Any, piece: Any, buf: torch.Tensor) -> torch.Tensor:
        if slot.name.startswith(FAULTY):
            raise RuntimeError(f"injected packing failure at {slot.name}")
        return real(slot, piece, buf)

    if rank == on_rank:
        sync_source._region = region

    def undo() -> None:
        sync_source._region = real

    return undo


def _try(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
        exc: BaseException | None = None
    except BaseException as e:  # noqa: BLE001 - reported
        exc = e
    return {
        "raised": type(exc).__name__ if exc is not None else None,
        "message": str(exc) if exc is not None else "",
        "rank": getattr(exc, "rank", None),
        "tensor": getattr(exc, "tensor", None),
        "ranks": list(getattr(exc, "ranks", None) or []),
        "seconds": time.monotonic() - t0,
    }


def case_colocated(rank: int, world: int, *, ckpt: str) -> dict[str, Any]:
    """Each rank's own plain engine: rank 1 fails to pack a group, then rank 1's engine fails to
    reload mid-pass; each is one named SyncError on every rank, and the next sync is whole. Last,
    rank 1's engine stalls longer than the sync's timeout: the peer's collective gives up."""
    model = _model(ckpt, world)
    llm = PlainLLM(
        PlainWorker(_engine_model(ckpt), fail_on=3 if rank == 1 else 0, stall_on=5 if rank == 1 else 0)
    )
    out: dict[str, Any] = {"first": _try(streamload.sync_weights, model, llm, timeout=30)}
    undo = _pack_fails_on(rank, 1)
    out["pack"] = _try(streamload.sync_weights, model, llm, timeout=30)
    undo()
    out["reload"] = _try(streamload.sync_weights, model, llm, timeout=30)
    out["after"] = _try(streamload.sync_weights, model, llm, timeout=30)
    out["equal"] = checksum(llm) == _trainer_sum(model)  # collective: every rank
    # Last (the group is unusable after it): rank 1's engine stalls mid-pass, longer than timeout=.
    out["stall"] = _try(streamload.sync_weights, model, llm, timeout=3)
    return out


def case_remote(rank: int, world: int, *, ckpt: str, port: int) -> dict[str, Any]:
    """One plain engine in its own process (``engine_main``): a sync; rank 1 fails to pack a
    group (named on every rank, the engine keeps serving); a whole sync again; an engine call that
    raises (on every rank); then the engine's process SIGKILLs itself in the middle of the fourth
    reload: ``EngineDeadError`` on every rank, and for a call after it."""
    model = _model(ckpt, world)
    remote = streamload.RemoteEngine(HOST, port, timeout=60)
    out: dict[str, Any] = {"first": _try(streamload.sync_weights, model, remote, timeout=20)}
    undo = _pack_fails_on(rank, 1)
    out["pack"] = _try(streamload.sync_weights, model, remote, timeout=20)
    undo()
    out["after"] = _try(streamload.sync_weights, model, remote, timeout=20)
    want = _trainer_sum(model)  # collective: every rank
    sums = remote.call(checksum)
    out["equal"] = None if sums is None else sums == want
    out["call"] = _try(remote.call, fails)
    out["killed"] = _try(streamload.sync_weights, model, remote, timeout=20)
    out["call_dead"] = _try(remote.call, checksum)
    return out


def engine_main(ckpt: str, port: int, trainers: int, die_on: int) -> None:
    """The engine process: serves one link until the trainers close it (or it dies)."""
    llm = PlainLLM(PlainWorker(_engine_model(ckpt), die_on=die_on))
    server = streamload.EngineServer(llm, HOST, port, trainers, timeout=60)
    print("engine up", file=sys.stderr, flush=True)
    server.serve(idle=120)


if __name__ == "__main__":
    engine_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))


def case_trainer_killed(rank: int, world: int, *, ckpt: str, port: int | None = None) -> dict[str, Any]:
    """The last rank SIGKILLs itself while it packs ``FAULTY``'s group, in a sync into colocated
    plain engines (``port`` None) or into the engine process at ``port``; the survivors report."""
    model = _model(ckpt, world)
    llm: Any = (
        PlainLLM(PlainWorker(_engine_model(ckpt)))
        if port is None
        else streamload.RemoteEngine(HOST, port, timeout=60)
    )
    streamload.sync_weights(model, llm, timeout=20)
    real = sync_source._region

    def region(slot: Any, piece: Any, buf: torch.Tensor) -> torch.Tensor:
        if slot.name.startswith(FAULTY):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(slot, piece, buf)

    if rank == world - 1:
        sync_source._region = region
    return _try(streamload.sync_weights, model, llm, timeout=20)


def case_engine_stopped(rank: int, world: int, *, ckpt: str, port: int) -> dict[str, Any]:
    """The engine's process SIGSTOPs itself in the middle of the second reload (alive, silent):
    the survivors' waits are bounded (the watch's short ping, the sync's ``timeout``)."""
    model = _model(ckpt, world)
    remote = streamload.RemoteEngine(HOST, port, timeout=60)
    streamload.sync_weights(model, remote, timeout=20)
    return _try(streamload.sync_weights, model, remote, timeout=5)
