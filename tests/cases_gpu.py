"""Rank-group cases for the GPU path's logic, run on CPU ranks (see rank_group.py):
the staged pipelines through a fake device backend that watches slot reuse, the
status flags on a gloo side group, and FSDP2 CPU offload on a CPU mesh."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from cases_load import MISSING_PATH, _process_group_count, compare_model, mesh_for, reference, tied

import streamload
from streamload.transport import protocol, staging
from streamload.transport.pack import Packer


class FakeStream:
    """A device stream on the CPU: an in-order queue of work run by its own worker thread.

    Work runs later than it is enqueued, in submission order. Lazily by default: op i runs
    only once something waits for it (an event recorded at or after it, ``synchronize``, or
    another stream's op waiting on such an event), so nothing completes that nobody asked for
    (the most asynchronous device that is still correct). ``eager`` runs ops as soon as the
    worker gets to them (a device racing the host).
    """

    TIMEOUT = 60.0  # a wait that never completes is a failure, never a hung test

    def __init__(self, name: str, eager: bool = False) -> None:
        self.name = name
        self.ops: list[Callable[[], None]] = []
        self.done = 0  # ops completed
        self.demand = 1 << 62 if eager else -1  # ops up to this index may run
        self.errors: list[BaseException] = []
        self.closed = False
        self.cv = threading.Condition()
        self.worker = threading.Thread(target=self._run, name=f"fake-{name}", daemon=True)
        self.worker.start()

    def submit(self, fn: Callable[[], None]) -> int:
        with self.cv:
            if self.closed:
                raise RuntimeError(f"fake stream {self.name} used after release")
            self.ops.append(fn)
            self.cv.notify_all()
            return len(self.ops) - 1

    def record(self) -> FakeEvent:
        """An event that completes when the worker reaches this point of the stream."""
        return FakeEvent(self, self.submit(lambda: None))

    def wait_for(self, seq: int) -> None:
        """Blocks until op ``seq`` has run (asking the worker to run up to it)."""
        with self.cv:
            self.demand = max(self.demand, seq)
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: self.done > seq or bool(self.errors), self.TIMEOUT):
                raise TimeoutError(
                    f"fake stream {self.name}: op {seq} never completed (ops wait in a cycle?)"
                )
            if self.errors:
                raise RuntimeError(f"fake stream {self.name} failed") from self.errors[0]

    def synchronize(self) -> None:
        with self.cv:
            last = len(self.ops) - 1
        if last >= 0:
            self.wait_for(last)

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.worker.join(self.TIMEOUT)

    def _run(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.closed or self.done <= min(self.demand, len(self.ops) - 1))
                if self.done >= len(self.ops) or self.done > self.demand:
                    return  # closed with nothing left that anyone asked for
                fn = self.ops[self.done]
            try:
                fn()  # outside the lock: it may wait on another stream's event
            except BaseException as exc:  # noqa: BLE001 - raised to whoever waits on this stream
                with self.cv:
                    self.errors.append(exc)
            with self.cv:
                self.done += 1
                self.cv.notify_all()


class FakeEvent:
    """A point on a FakeStream (``stream=None``: one the host already passed, i.e. done)."""

    def __init__(self, stream: FakeStream | None = None, seq: int = -1) -> None:
        self.stream, self.seq = stream, seq

    @property
    def done(self) -> bool:
        return self.stream is None or self.stream.done > self.seq

    def synchronize(self) -> None:
        """Really waits: blocks until the stream's worker has passed this event."""
        if self.stream is not None:
            self.stream.wait_for(self.seq)


POISON = 0xA5  # fresh device buffers hold this: bytes read before their copy landed show


class FakeBackend:
    """A device backend for ``staging.Stager`` on the CPU: asynchronous copies, real waits.

    Copies run on a copy stream (a worker thread, see ``FakeStream``) after the event they
    were told to follow; ``copy`` returns at once and reads the host slot only when the
    copy runs, so a slot repacked too early, or a device buffer read before its copy, gives
    wrong bytes. The compute stream is the host by default (the CPU pipelines unpack and
    send eagerly, so ``compute_waits`` blocks the host, as a CUDA stream would block the
    kernels enqueued after it); ``compute="stream"`` makes it a second worker thread that
    runs what ``on_compute`` enqueues (lazily), for tests that drive a Stager by hand.

    Each missing wait of a Stager shows as wrong bytes under one schedule: the compute
    stream's wait for a copy under ``compute="host"`` with lazy copies; the wait for a
    slot's last copy under ``compute="stream"`` with lazy copies; the device buffer's wait
    for its last consumer under ``compute="stream"`` with ``eager`` copies.

    The consumer the pipeline enqueues with ``Stager.on_compute`` (the owners pipeline's
    unpack) runs on the compute stream: under ``compute="stream"`` in stream order, after
    the copy it waited for, so events recorded there complete only once it ran. A consumer
    that is a collective (the src reader's) is the host's work, so that pipeline runs with
    ``compute="host"``.
    """

    LOG: list[dict[str, Any]] = []
    EAGER = False  # the pipeline cases flip it to run the copy worker eagerly
    COMPUTE = "host"  # the pipeline cases' compute stream ("stream": a worker, see above)

    def __init__(self, device: torch.device, compute: str | None = None, eager: bool | None = None) -> None:
        self.rec: dict[str, Any] = {
            "slots": 0,
            "copies": 0,
            "overlaps": 0,
            "compute_waits": 0,
            "violations": [],
            "released": False,
        }
        FakeBackend.LOG.append(self.rec)
        eager = FakeBackend.EAGER if eager is None else eager
        compute = FakeBackend.COMPUTE if compute is None else compute
        self.hosts: list[torch.Tensor] = []
        self.events: list[FakeEvent] = []
        self.last: dict[int, FakeEvent] = {}
        self.stream = FakeStream("copy", eager)
        self.compute = FakeStream("compute") if compute == "stream" else None

    def host_buffer(self, nbytes: int, lock: bool = True) -> torch.Tensor:
        self.hosts.append(torch.full((nbytes,), POISON, dtype=torch.uint8))
        self.rec["slots"] += 1
        return self.hosts[-1]

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def _slot(self, src: torch.Tensor) -> int:
        for i, h in enumerate(self.hosts):
            if h.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
                return i
        raise AssertionError("copy from memory that is not a host slot")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> FakeEvent:
        if any(h.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr() for h in self.hosts):
            return self._download(dst, src, after)
        slot = self._slot(src)
        prev = self.last.get(slot)
        if prev is not None and not prev.done:
            self.rec["violations"].append(f"slot {slot} repacked while its previous copy was outstanding")
        if any(not e.done for e in self.events):
            self.rec["overlaps"] += 1  # this bucket was packed while an earlier copy was still in flight
        sent = src.clone()  # what the slot held when the copy was issued

        def run() -> None:
            after.synchronize()  # the copy stream waits for the event it was given
            if not torch.equal(src, sent):
                self.rec["violations"].append(f"slot {slot} changed before its copy completed")
            dst.copy_(src)  # what the slot holds now, as a DMA engine would read it

        self.stream.submit(run)
        event = self.stream.record()
        self.last[slot] = event
        self.events.append(event)
        self.rec["copies"] += 1
        return event

    def _download(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> FakeEvent:
        """Device -> host slot (a save's read): runs when something waits for it (lazy) or at
        once (eager), after ``after``; a slot read before its event was waited for holds the
        bytes of its previous copy (or POISON), a slot refilled while the host still reads it
        changes under the reader."""
        slot = self._slot(dst)
        prev = self.last.get(slot)
        if prev is not None and not prev.done:
            self.rec["violations"].append(f"slot {slot} refilled while its previous copy was outstanding")

        def run() -> None:
            after.synchronize()
            dst.copy_(src)

        self.stream.submit(run)
        event = self.stream.record()
        self.last[slot] = event
        self.events.append(event)
        self.rec["copies"] += 1
        self.rec["downloads"] = self.rec.get("downloads", 0) + 1
        return event

    def compute_waits(self, event: Any) -> None:
        """The compute stream waits for ``event``: the host itself, or the compute worker."""
        self.rec["compute_waits"] += 1
        if self.compute is None:
            event.synchronize()
        else:
            self.compute.submit(event.synchronize)

    def record_compute(self) -> FakeEvent:
        return FakeEvent() if self.compute is None else self.compute.record()

    def on_compute(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` on the compute stream: now on the host, else enqueued on its worker."""
        if self.compute is None:
            fn()
        else:
            self.compute.submit(fn)

    def wait(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()
        if self.compute is not None:
            self.compute.synchronize()

    def release(self) -> None:
        self.rec["released"] = True
        self.rec["unobserved"] = sum(not e.done for e in self.events)  # copies nobody waited for
        try:
            self.synchronize()  # they still run before their slots go
        finally:
            self.stream.close()
            if self.compute is not None:
                self.compute.close()
            self.hosts.clear()


SKIPS = ("compute", "slot", "buffer")


@contextlib.contextmanager
def skipping(which: str | None) -> Iterator[None]:
    """Runs the staging code with one of its waits taken out (None: as it is).

    ``compute``: the compute stream does not wait for a bucket's copy (``Stager.push``);
    ``slot``: a host slot is packed without waiting for the copy that last read it
    (``Stager.host``); ``buffer``: a copy into a device buffer does not wait for the
    previous bucket's consumer (the event ``Stager.consumed`` recorded).
    """
    real_host, real_push = staging.Stager.host, staging.Stager.push

    def host(self: staging.Stager, k: int) -> torch.Tensor:
        self.copied[k % self.slots] = None  # forget the copy still reading the slot
        return real_host(self, k)

    def push(self: staging.Stager, k: int, wire: torch.Tensor) -> torch.Tensor:
        if which == "buffer":
            self.freed[k % self.slots] = FakeEvent()  # as if its consumer were done
            return real_push(self, k, wire)
        backend = self.backend
        real_waits = backend.compute_waits
        backend.compute_waits = lambda event: None  # type: ignore[method-assign]
        try:
            return real_push(self, k, wire)
        finally:
            backend.compute_waits = real_waits  # type: ignore[method-assign]

    if which is not None:
        assert which in SKIPS, which
        if which == "slot":
            staging.Stager.host = host  # type: ignore[method-assign]
        else:
            staging.Stager.push = push  # type: ignore[method-assign]
    try:
        yield
    finally:
        staging.Stager.host, staging.Stager.push = real_host, real_push  # type: ignore[method-assign]


def case_fake_stager(
    rank: int,
    world: int,
    *,
    ckpt: str,
    ws: int,
    readers: str,
    eager: bool = False,
    skip: str | None = None,
    compute: str = "host",
) -> dict | None:
    """Loads through the staged pipeline (asynchronous fake device backend) and returns what it
    saw and which parameters differ from transformers' (``skip`` takes one wait out;
    ``compute``: the fake's compute stream, see ``FakeBackend``)."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    from streamload.load import prepare

    FakeBackend.LOG.clear()
    staging.BACKENDS["cpu"] = FakeBackend
    FakeBackend.EAGER, FakeBackend.COMPUTE = eager, compute
    # On the CPU, owners loads take one coarse bucket (nothing is staged there); here they stage.
    coarse, prepare.OWNERS_CPU_BUCKET_BYTES = prepare.OWNERS_CPU_BUCKET_BYTES, 0
    try:
        path = ckpt if readers == "owners" or rank == 0 else MISSING_PATH
        with skipping(skip):
            model = streamload.from_pretrained(
                path, device_mesh=mesh, bucket_bytes=2048, progress=False, readers=readers, map_files=False
            )
    finally:
        del staging.BACKENDS["cpu"]
        FakeBackend.EAGER, FakeBackend.COMPUTE = False, "host"
        prepare.OWNERS_CPU_BUCKET_BYTES = coarse
    ref = reference(ckpt, None)
    bad = compare_model(model, ref)
    assert tied(model) == tied(ref)
    return {"log": list(FakeBackend.LOG), "buckets": model.streamload_report.buckets, "bad": bad}


def case_staging_alloc_fails(
    rank: int, world: int, *, ckpt: str, ws: int, readers: str, fail: int
) -> str | None:
    """Page-locking the staging slots fails on rank ``fail`` only: every rank must raise
    (the allocation is agreed on before the first bucket), none may wait in a collective."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    from streamload.load import prepare

    class Failing(FakeBackend):
        def host_buffer(self, n: int) -> Any:
            if rank == fail:
                raise RuntimeError("cudaHostRegister refused (simulated)")
            return super().host_buffer(n)

    staging.BACKENDS["cpu"] = Failing
    coarse, prepare.OWNERS_CPU_BUCKET_BYTES = prepare.OWNERS_CPU_BUCKET_BYTES, 0
    t0 = time.perf_counter()
    try:
        path = ckpt if readers == "owners" or rank == 0 else MISSING_PATH
        streamload.from_pretrained(
            path, device_mesh=mesh, bucket_bytes=2048, progress=False, readers=readers, map_files=False
        )
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        assert time.perf_counter() - t0 < 60
        return f"{type(exc).__name__}: {exc}"
    finally:
        del staging.BACKENDS["cpu"]
        prepare.OWNERS_CPU_BUCKET_BYTES = coarse
    return "loaded"


def _counting_new_group(calls: list[Any]) -> Any:
    real = dist.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    return real, new_group


def case_side_group(rank: int, world: int, *, ckpt: str, loads: int = 3) -> dict:
    """Loads with the status flags forced onto a gloo side group, as on NCCL: one group per
    load, destroyed with it (after a failure too), and the same error on every rank."""
    mesh = mesh_for(world)
    real_needs, real_pack = protocol.needs_side_group, Packer.pack
    calls: list[Any] = []
    real_new_group, counting = _counting_new_group(calls)
    protocol.needs_side_group = lambda group, device: True
    dist.new_group = counting
    counts, errors = [], []
    before = _process_group_count()
    try:
        for i in range(loads):
            readers = "owners" if i % 2 == 0 else "src"
            path = ckpt if readers == "owners" or rank == 0 else MISSING_PATH
            model = streamload.from_pretrained(
                path, device_mesh=mesh, bucket_bytes=4096, progress=False, readers=readers
            )
            assert not compare_model(model, reference(ckpt, None))
            counts.append(_process_group_count())
        if rank == 1:

            def pack(self: Packer, bucket: Any, slot: Any, only: Any = None) -> Any:
                raise streamload.CheckpointFileError("injected on rank 1", ckpt, "bucket")

            Packer.pack = pack  # type: ignore[method-assign]
        try:
            streamload.from_pretrained(
                ckpt, device_mesh=mesh, bucket_bytes=4096, progress=False, readers="owners"
            )
        except streamload.CheckpointFileError as exc:
            errors.append((type(exc).__name__, exc.rank))
        counts.append(_process_group_count())
    finally:
        protocol.needs_side_group = real_needs
        dist.new_group = real_new_group
        Packer.pack = real_pack  # type: ignore[method-assign]
    return {"before": before, "counts": counts, "gloo_groups": calls.count("gloo"), "errors": errors}


def _offloaded_meta_model(ckpt: str, mesh: Any, pin: bool = False) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamload.model.state import rebind_ties, record_state

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    rebind_ties(model, record_state(model).ties)  # transformers ties lazily; tie before sharding
    policy = CPUOffloadPolicy(pin_memory=pin)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def case_offload(
    rank: int, world: int, *, ckpt: str, ws: int, readers: str, verl: bool = False
) -> dict | None:
    """Loads into a meta model sharded with FSDP2 CPUOffloadPolicy on a CPU mesh, then trains a step."""
    from streamload.model.offload import offloads_to_cpu

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model = _offloaded_meta_model(ckpt, mesh)
    assert offloads_to_cpu(model)
    path = ckpt if readers == "owners" or rank == 0 else MISSING_PATH
    if verl:
        full_state = streamload.Checkpoint(ckpt) if rank == 0 else {}
        from torch.distributed.fsdp import CPUOffloadPolicy

        streamload.fsdp2_load_full_state_dict(
            model, full_state, mesh, cpu_offload=CPUOffloadPolicy(pin_memory=False)
        )
    else:
        streamload.load_checkpoint(
            model, path, device_mesh=mesh, bucket_bytes=4096, progress=False, readers=readers
        )
    ref = reference(ckpt, None)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    assert tied(model) == tied(ref)
    devices = {p.to_local().device.type for p in model.parameters()}
    # FSDP2 checks at its first forward that offloaded parameters are on the CPU.
    ids = torch.arange(6).view(1, 6) % ref.config.vocab_size
    model(input_ids=ids).logits.float().sum().backward()
    return {"devices": sorted(devices)}


def case_offload_placement(rank: int, world: int, *, ckpt: str) -> dict:
    """materialize_offloaded: sharded parameters on the CPU, buffers on the device (meta stands in)."""
    from torch.distributed.tensor import DTensor

    from streamload.model.offload import materialize_offloaded, offloads_to_cpu

    mesh = mesh_for(world)
    offloaded = _offloaded_meta_model(ckpt, mesh)
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        unoffloaded = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
    fully_shard(unoffloaded, mesh=mesh)
    materialize_offloaded(offloaded, torch.device("meta"))
    params = {
        type(p).__name__: p.to_local().device.type for p in offloaded.parameters() if isinstance(p, DTensor)
    }
    buffers = {b.device.type for b in offloaded.buffers()}
    return {"params": params, "buffers": sorted(buffers), "detects": offloads_to_cpu(unoffloaded)}


def _sharded_meta_model(ckpt: str, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamload.model.state import rebind_ties, record_state

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    rebind_ties(model, record_state(model).ties)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _record_device(model: Any, device: torch.device) -> None:
    """As if ``fully_shard`` had run with ``device`` current (FSDP2's private state)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module._get_fsdp_state()._device = device


def case_fsdp_device(rank: int, world: int, *, ckpt: str) -> dict:
    """The device FSDP2 recorded decides where a meta model is materialised; a load whose
    device differs (on one rank only) raises on every rank, naming both devices there."""
    from types import SimpleNamespace

    from streamload.model.placement import resolve_device
    from streamload.model.state import check_fsdp_device, fsdp_device

    mesh = mesh_for(world)
    model = _sharded_meta_model(ckpt, mesh)
    out: dict[str, Any] = {"recorded": str(fsdp_device(model))}  # also the guard on FSDP2's private state
    _record_device(model, torch.device("cuda", 2))
    real_current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    try:
        # Not the current device (0): the one fully_shard recorded.
        out["resolved"] = str(resolve_device(model, SimpleNamespace(device_type="cuda"), None))
        bound = SimpleNamespace(bound_device_id=torch.device("cuda", 5))
        out["resolved_bound"] = str(resolve_device(model, SimpleNamespace(device_type="cuda"), bound))  # type: ignore[arg-type]
    finally:
        torch.cuda.current_device = real_current  # type: ignore[assignment]
    try:
        check_fsdp_device(model, torch.device("cuda", 5))
        out["check"] = "passed"
    except streamload.PlacementError as exc:
        out["check"] = str(exc)
    # A real load on the CPU mesh where rank 1's model says fully_shard ran on cuda:1.
    model = _sharded_meta_model(ckpt, mesh)
    if rank == 1:
        _record_device(model, torch.device("cuda", 1))
    t0 = time.perf_counter()
    try:
        streamload.load_checkpoint(model, ckpt, device_mesh=mesh, progress=False)
        out["load"] = "loaded"
    except streamload.StreamloadError as exc:
        out["load"] = f"{type(exc).__name__}: {exc}"
    out["load_s"] = time.perf_counter() - t0
    return out


def case_save_side_group(rank: int, world: int, *, ckpt: str, out: str) -> dict:
    """Saves with the agreements forced onto a gloo twin of the group, as on an NCCL-only
    group: one group per save, destroyed with it (after a failure too), every agreement on
    the twin, and a failing rank one SaveError naming it on every rank."""
    import streamload.save.commit as commit
    import streamload.save.driver as driver
    import streamload.save.tiling as tiling

    mesh = mesh_for(world)
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, bucket_bytes=4096, progress=False)
    real_needs, real_new_group = protocol.needs_side_group, dist.new_group
    real_gathers = commit.all_gather_object, tiling.all_gather_object
    real_write = driver.write_owners
    calls: list[Any] = []
    _, counting = _counting_new_group(calls)
    on_world: list[str] = []

    def gather(where: str, real: Callable) -> Callable:
        def wrapped(obj: Any, group: Any, device: Any) -> Any:
            if group is None or group == dist.group.WORLD:
                on_world.append(where)
            return real(obj, group, device)

        return wrapped

    protocol.needs_side_group = lambda group, device: True
    dist.new_group = counting
    commit.all_gather_object = gather("commit", real_gathers[0])
    tiling.all_gather_object = gather("tiling", real_gathers[1])
    counts, errors = [], []
    before = _process_group_count()
    try:
        for writers in ("owners", "src"):
            streamload.save_pretrained(model, f"{out}-{writers}", writers=writers, bucket_bytes=4096)
            counts.append(_process_group_count())
        if rank == 1:

            def write_owners(*args: Any, **kwargs: Any) -> Any:
                raise OSError(28, "No space left on device (injected on rank 1)")

            driver.write_owners = write_owners
        try:
            streamload.save_pretrained(model, f"{out}-fails", writers="owners", bucket_bytes=4096)
        except streamload.SaveError as exc:
            errors.append((type(exc).__name__, exc.rank))
        counts.append(_process_group_count())
    finally:
        protocol.needs_side_group, dist.new_group = real_needs, real_new_group
        commit.all_gather_object, tiling.all_gather_object = real_gathers
        driver.write_owners = real_write
    return {
        "before": before,
        "counts": counts,
        "gloo_groups": calls.count("gloo"),
        "errors": errors,
        "on_world": on_world,
    }


def case_fake_save(
    rank: int, world: int, *, ckpt: str, out: str, eager: bool, skip_wait: bool = False
) -> dict:
    """Saves (owners and src, fp8 too) with the shards staged through the asynchronous fake device
    (``save.stage``): every piece leaves the "device" by a copy into a host slot. ``skip_wait``
    hands a slot out without waiting for its copy (the test sees wrong bytes)."""
    from streamload.save import stage

    mesh = mesh_for(world)
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, progress=False, dtype=torch.float32)
    saves = {
        "owners": {"writers": "owners"},
        "src": {"writers": "src"},
        "bf16": {"writers": "owners", "dtype": torch.bfloat16},
        "fp8": {"writers": "src", "quantize": "fp8"},
    }
    for name, kw in saves.items():  # the reference: nothing staged (the CPU)
        streamload.save_pretrained(model, f"{out}-ref-{name}", bucket_bytes=4096, max_shard_size="16KB", **kw)
    FakeBackend.LOG.clear()
    staging.BACKENDS["cpu"] = FakeBackend
    FakeBackend.EAGER = eager
    real_ready = stage.DeviceReader._ready
    if skip_wait:
        stage.DeviceReader._ready = lambda self, pending: (pending[0], pending[1])  # type: ignore[method-assign]
    reports = {}
    try:
        for name, kw in saves.items():
            rep = streamload.save_pretrained(
                model, f"{out}-{name}", bucket_bytes=4096, max_shard_size="16KB", **kw
            )
            reports[name] = rep.bytes_written
    finally:
        del staging.BACKENDS["cpu"]
        FakeBackend.EAGER = False
        stage.DeviceReader._ready = real_ready  # type: ignore[method-assign]
    return {"log": list(FakeBackend.LOG), "bytes": reports}
