"""A vLLM engine in a process of its own, fed by the trainer ranks over torch.distributed.

Two sides, one link:

- **Engine side** (``EngineServer``, in the engine's process): hosts a ``TCPStore`` (the link's
  control plane), posts the engine's config and ties there, and joins a process group made for
  the transfer only: every trainer rank plus the engine, which is its last rank. The group is
  built from the store directly (``ProcessGroupGloo(store, rank, size)``; NCCL on devices), so
  it is never registered with torch.distributed: neither the trainer's default group nor the
  engine's own (vLLM makes one per engine) is ever touched by the other side. The receiving end
  runs inside the engine's worker (``collective_rpc`` of this module's functions), where the
  model is, so the same code serves an in-process engine core and a multiprocess one.
- **Trainer side** (``RemoteEngine``, on every trainer rank): connects to the store, joins the
  transfer group, and is what ``sync_weights`` takes in place of a ``vllm.LLM``. Trainer rank 0
  posts the requests (``req/<n>``: the groups' plan, once per change of plan); the engine
  answers each (``resp/<n>``).

A sync is then a ``HubSource`` whose one collective per layer group is a ``reduce`` over the
transfer group to the engine: every byte of the group comes from exactly one trainer rank, the
engine adds zeros, the engine's buffer is the group's hub tensors, and its worker hands them to
``reload_weights`` as views. An engine whose reload fails keeps receiving to the end of the pass
(no trainer rank is left in a collective) and reports the failure. An engine process that died
takes its store with it: every trainer rank's next request to the store fails, which the sync
agrees on over the trainer's own group (``EngineDeadError`` on every rank); in the middle of a
transfer every trainer rank's wait in a reduce pings the store once a second, so the same error
comes about a second after the engine died. A trainer rank that fails to pack a group sends zeros,
with its flag in the buffer's trailing words (``groups.FLAG_BYTES``), to the end of the pass: the
engine stops feeding its reload there and answers which rank it was.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..model.placement import resolve_device, resolve_group
from ..transport.arrival import meeting
from ..transport.protocol import carries_cpu, gather_or_raise
from .buffers import BufferPool, Handout, wait_released
from .errors import EngineDeadError, SyncError
from .groups import FLAG_BYTES, Group, Slot
from .vllm_engine import refresh_experts, worker_info

_PREFIX = "streamload/sync/"
_LINKS: dict[str, Any] = {}  # in the engine's worker: link id -> its transfer group
# In the engine's worker: link id -> its group buffers (one reused through a pass and kept for the
# next, as on the trainers' side: no fresh pages faulted in per group or per sync).
_POOLS: dict[str, BufferPool] = {}
# How long a transfer's watch waits for the engine's store to answer (a stopped engine's process).
WATCH_SECONDS = 5.0
_CHUNK = 4 << 20  # a TCPStore value is at most 8 MiB: larger messages go in pieces
# The link's wire format (the group buffers' trailing flag words, the requests): both sides must
# speak the same one. Raise it with any change to either.
PROTOCOL = 2


def _put(store: Any, key: str, obj: Any) -> None:
    """Sets ``key`` to ``obj`` pickled, in pieces under ``key/<i>``; ``key`` itself (the piece
    count) is set last, so a reader that sees it finds every piece."""
    data = pickle.dumps(obj)
    pieces = range(0, max(len(data), 1), _CHUNK)
    for i, lo in enumerate(pieces):
        store.set(f"{key}/{i}", data[lo : lo + _CHUNK])
    store.set(key, str(len(pieces)))


def _take(store: Any, key: str, timeout: float) -> Any:
    """Waits up to ``timeout`` seconds for ``_put``'s ``key`` and returns the object."""
    store.wait([key], timedelta(seconds=timeout))
    n = int(store.get(key))
    return pickle.loads(b"".join(store.get(f"{key}/{i}") for i in range(n)))


def _transfer_group(store: Any, rank: int, world: int, backend: str, timeout: float) -> Any:
    prefixed = dist.PrefixStore(_PREFIX + "pg", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=timeout))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")


# -- engine side -------------------------------------------------------------------------------


class EngineServer:
    """The engine's end of a link: serves one trainer job's syncs into ``llm``.

    Args:
        llm: the engine (``vllm.LLM``) in this process.
        host: the address the trainer ranks reach this process at.
        port: the link's store port (trainers pass the same to ``RemoteEngine``).
        trainers: the number of trainer ranks that feed it (the transfer group is trainers + 1).
        backend: ``"gloo"`` (CPU engine) or ``"nccl"`` (the engine's device).
        timeout: seconds a collective of the link may wait.

    Example:
        >>> llm = LLM(model=ckpt, ...)
        >>> EngineServer(llm, "10.0.0.5", 29600, trainers=8).serve()  # until the trainers close
    """

    def __init__(
        self, llm: Any, host: str, port: int, trainers: int, *, backend: str = "gloo", timeout: float = 300.0
    ) -> None:
        self.llm = llm
        self.host, self.port, self.trainers = host, port, trainers
        self.backend, self.timeout = backend, timeout
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
        )
        info = dict(llm.collective_rpc(worker_info)[0])
        info["trainers"] = trainers
        info["protocol"] = PROTOCOL
        _put(self.store, _PREFIX + "info", info)
        self.handled = 0

    def serve(self, idle: float | None = None) -> int:
        """Joins the transfer group and answers requests until the trainers close the link.

        Args:
            idle: give up after this many seconds without a request (None: wait forever).

        Returns:
            The number of syncs done.
        """
        key = f"{self.host}:{self.port}"
        self.llm.collective_rpc(
            worker_connect, args=(key, self.host, self.port, self.trainers, self.backend, self.timeout)
        )
        plan: list[Any] | None = None
        syncs = 0
        n = 0
        while True:
            req = self._next(n, idle)
            op = req.get("op")
            try:
                if op == "close":
                    self._answer(n, {"ok": True})
                    return syncs
                if op == "sync":
                    if req.get("plan") is not None:
                        plan = req["plan"]
                    assert plan is not None, "a sync request before any plan"
                    out = self.llm.collective_rpc(worker_receive, args=(key, plan))[0]
                    out["rss"] = _rss()
                    syncs += 1
                    self._answer(n, out)
                elif op == "call":
                    self._answer(n, {"ok": True, "result": req["fn"](self.llm, *req.get("args", ()))})
                else:
                    self._answer(n, {"ok": False, "error": f"unknown request {op!r}"})
            except Exception as exc:  # noqa: BLE001 - the trainers get it as the request's answer
                self._answer(n, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            n += 1
            self.handled = n

    def _next(self, n: int, idle: float | None) -> dict[str, Any]:
        t0 = time.monotonic()
        while True:
            try:
                return dict(_take(self.store, f"{_PREFIX}req/{n}", 5.0))
            except dist.DistStoreError:
                if idle is not None and time.monotonic() - t0 > idle:
                    raise

    def _answer(self, n: int, reply: dict[str, Any]) -> None:
        _put(self.store, f"{_PREFIX}resp/{n}", reply)


def worker_connect(
    worker: Any, key: str, host: str, port: int, trainers: int, backend: str, timeout: float
) -> None:
    """Runs in the engine's worker: joins the link's transfer group as its last rank."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    _LINKS[key] = (_transfer_group(store, trainers, trainers + 1, backend, timeout), store)


def worker_receive(
    worker: Any, key: str, plan: list[tuple[int, list[tuple[str, str, tuple[int, ...], int]]]]
) -> dict:
    """Runs in the engine's worker: one pass of the trainers' groups into ``reload_weights``.

    Every group is received (one ``reduce`` each) even when the reload fails part way, or a
    trainer rank flags that it failed to pack a group (the flag words after the group's bytes,
    ``groups.FLAG_BYTES``: the reload then gets nothing more and the answer says which rank): the
    trainer ranks are in those collectives.
    """
    pg = _LINKS[key][0]
    device = torch.device("cpu") if isinstance(pg, dist.ProcessGroupGloo) else worker.device
    state: dict[str, Any] = {"next": 0, "aborted": None}
    pool = _POOLS.setdefault(key, BufferPool(device))
    size = max(n for n, _ in plan) + FLAG_BYTES
    handout = Handout()

    def receive() -> torch.Tensor:
        i = state["next"]
        buf = pool.take(plan[i][0] + FLAG_BYTES, size)  # zero throughout: the engine adds no bytes
        opts = dist.ReduceOptions()
        opts.rootRank = pg.rank()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        words = buf.view(torch.int32)
        pg.reduce([words], opts).wait()
        wait_released(words)
        del words
        state["next"] = i + 1
        count, ids = (int(x) for x in buf[plan[i][0] :].view(torch.int32)[:2].tolist())
        if count and state["aborted"] is None:
            who = f"trainer rank {ids - 1}" if count == 1 else f"{count} trainer ranks"
            state["aborted"] = (
                f"{who} failed to pack layer group {i}: the reload got the groups before it only"
            )
        return buf

    def groups() -> Iterator[tuple[str, torch.Tensor]]:
        # As HubSource.iter_groups: tensors over the buffer, none of it held here when the next group
        # is received, and what the reload still holds of a group moved off its buffer (let_go):
        # one group buffer alive at a time in the engine's process too.
        while state["next"] < len(plan) and state["aborted"] is None:
            handout.take_back()
            nbytes, slots = plan[state["next"]][0], plan[state["next"]][1]
            buf = receive()
            if state["aborted"] is not None:
                return
            pairs = [(name, Slot(name, dt, tuple(shape), off).over(buf)) for name, dt, shape, off in slots][
                ::-1
            ]
            handout.give([t for _, t in pairs], buf, nbytes)
            del buf
            while pairs:
                yield pairs.pop()

    t0 = time.perf_counter()
    error = None
    refreshed = 0
    try:
        worker.reload_weights(weights_iterator=groups())
        if state["aborted"] is None:
            refreshed = refresh_experts(worker.model_runner.get_model())
    except Exception as exc:  # noqa: BLE001 - reported to the trainers after the pass
        error = f"{type(exc).__name__}: {exc}"
    while state["next"] < len(plan):  # the rest of the pass (none left after a reload that took it all)
        receive()
    handout.take_back()  # what the reload still holds of the last group, so its buffer can stay
    held = pool.clear(keep=True)
    if state["aborted"] is not None:
        error = state["aborted"]
    return {
        "ok": error is None,
        "error": error,
        "aborted": state["aborted"] is not None,
        "seconds": time.perf_counter() - t0,
        "refreshed": refreshed,
        "held_groups": held,
        "kept": pool.kept_bytes,
    }


def _said(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}"


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


# -- trainer side ------------------------------------------------------------------------------


class RemoteEngine:
    """A trainer job's handle on an engine in another process (``EngineServer``).

    Collective over the trainer's group: every trainer rank makes one, together, while the
    engine's ``serve()`` waits. ``sync_weights(model, remote)`` then feeds it.

    Args:
        host, port: the engine's ``EngineServer`` address.
        process_group: the trainer's group (default: the default group).
        backend: the transfer group's backend (the engine's: gloo on CPU, nccl on devices).
        timeout: seconds to wait for the engine (store requests, collectives).

    Example:
        >>> remote = streamload.RemoteEngine("10.0.0.5", 29600)
        >>> streamload.sync_weights(model, remote)
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        process_group: dist.ProcessGroup | None = None,
        backend: str = "gloo",
        timeout: float = 300.0,
    ) -> None:
        self.group = resolve_group(process_group, None)
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.timeout = timeout
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        self.info: dict[str, Any] = _take(self.store, _PREFIX + "info", timeout)
        if self.info.get("protocol") != PROTOCOL:
            # Another streamload on the engine's side would misread the flag words of every group.
            raise SyncError(
                f"the engine at {host}:{port} speaks link protocol {self.info.get('protocol', 1)}, this "
                f"trainer {PROTOCOL}: run the same streamload version on both sides",
                rank=self.rank,
            )
        if self.info["trainers"] != self.world:
            raise SyncError(
                f"the engine at {host}:{port} expects {self.info['trainers']} trainer ranks, this job has {self.world}",
                rank=self.rank,
            )
        self.engine_rank = self.world
        self.pg = _transfer_group(self.store, self.rank, self.world + 1, backend, timeout)
        self.address = f"{host}:{port}"
        self.device = (  # where the trainer group's own collectives (agreements) carry objects
            torch.device("cpu")
            if self.group is None or carries_cpu(self.group)
            else resolve_device(torch.nn.Module(), None, self.group)
        )
        self._n = 0
        self._plan_sent: Any = None

    # The engine's questions, answered from the store (a dead engine process took it along).

    def ping(self, timeout: float | None = None) -> None:
        """Raises EngineDeadError unless the engine's process still answers within ``timeout``
        seconds (None: the link's). The store is served by a thread of its own in the engine's
        process, so a busy engine answers; a dead one does not, nor a stopped one (whose socket
        still takes the request: no store call bounds its wait for the reply, so the request
        runs in a thread of its own, waited for ``timeout``)."""
        limit = min(timeout or self.timeout, self.timeout)
        box: dict[str, BaseException | None] = {}

        def ask() -> None:
            try:
                self.store.add(_PREFIX + "ping", 0)
                box["error"] = None
            except Exception as exc:  # noqa: BLE001 - any failure of the store means the process is gone
                box["error"] = exc

        asking = threading.Thread(target=ask, name="streamload-engine-ping", daemon=True)
        asking.start()
        asking.join(limit)
        if "error" not in box or box["error"] is not None:
            why = f"no answer within {limit:g} s" if "error" not in box else _said(box["error"])
            raise EngineDeadError(
                f"the engine at {self.address} does not answer ({why})",
                rank=self.rank,
                hint="restart the engine process and connect a new RemoteEngine",
            ) from box.get("error")

    def watch(self) -> None:
        """``ping`` with a short wait: what a transfer's collective calls between its slices."""
        self.ping(WATCH_SECONDS)

    def probe(self) -> dict[str, Any]:
        """The engine's config and ties (as it posted them), once its process still answers."""
        self.ping()
        return self.info

    def alive(self) -> bool:
        """Whether the engine's process still answers (see ``ping``)."""
        try:
            self.ping()
        except EngineDeadError:
            return False
        return True

    def request(self, req: dict[str, Any] | None) -> dict[str, Any] | None:
        """Posts ``req`` (on trainer rank 0; other ranks pass anything) and returns its answer
        on rank 0 (None elsewhere). Every trainer rank calls it, in the same order."""
        n = self._n
        self._n += 1
        if self.rank != 0:
            return None
        try:
            _put(self.store, f"{_PREFIX}req/{n}", req)
            return dict(_take(self.store, f"{_PREFIX}resp/{n}", self.timeout))
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower():
                raise EngineDeadError(
                    f"the engine at {self.address} did not answer within {self.timeout} s", rank=self.rank
                ) from exc
            raise self.dead_error(exc) from exc
        except Exception as exc:  # noqa: BLE001
            raise self.dead_error(exc) from exc

    def post(self, req: dict[str, Any]) -> None:
        """Posts ``req`` without waiting (rank 0); ``answer`` collects it."""
        if self.rank == 0:
            try:
                _put(self.store, f"{_PREFIX}req/{self._n}", req)
            except Exception as exc:  # noqa: BLE001
                raise self.dead_error(exc) from exc
        self._n += 1

    def answer(self) -> dict[str, Any] | None:
        """The answer to the last ``post`` (rank 0; None elsewhere)."""
        if self.rank != 0:
            return None
        n = self._n - 1
        try:
            return dict(_take(self.store, f"{_PREFIX}resp/{n}", self.timeout))
        except Exception as exc:  # noqa: BLE001
            raise self.dead_error(exc) from exc

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn(llm, *args)`` in the engine's process (a module-level function, pickled by
        reference); returns its result on trainer rank 0, None on the others.

        Collective over the trainer's group: every trainer rank calls it, and a failure (the
        call's own error, or the engine gone) is raised on every rank.

        Raises:
            EngineDeadError: the engine's process does not answer (on every rank).
            SyncError: ``fn`` raised in the engine (on every rank, with its message).

        Example:
            >>> remote.call(generate, prompts)
        """
        with meeting("RemoteEngine.call", self.group, self.timeout):
            out: dict[str, Any] | None = None
            local: BaseException | None = None
            try:
                out = self.request({"op": "call", "fn": fn, "args": args})
                if out is not None and not out["ok"]:
                    local = SyncError(f"the engine's call failed: {out['error']}", rank=self.rank)
            except Exception as exc:  # noqa: BLE001 - agreed below
                local = exc
            gather_or_raise(None, local, self.rank, self.group, self.device)
        return None if out is None else out.get("result")

    def close(self) -> None:
        """Ends the link (the engine's ``serve()`` returns; no answer awaited: the engine may
        drop the store as soon as it read this). Every trainer rank calls it."""
        self.post({"op": "close"})

    def plan_for(self, groups: list[Group]) -> Any:
        """The plan to send with the next sync: the groups' layout, or None when the engine has
        it from the last sync already."""
        plan = [(g.nbytes, [(s.name, s.dtype, s.shape, s.offset) for s in g.slots]) for g in groups]
        if plan == self._plan_sent:
            return None
        self._plan_sent = plan
        return plan

    def dead_error(self, exc: BaseException) -> EngineDeadError:
        return EngineDeadError(
            f"the engine at {self.address} is gone ({type(exc).__name__}: {exc})",
            rank=self.rank,
            hint="restart the engine process and connect a new RemoteEngine",
        )
