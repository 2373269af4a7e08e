"""Rank-group cases for the GPU path's logic, run on CPU ranks (see rank_group.py):
the staged pipelines through a fake device backend that watches slot reuse, the
status flags on a gloo side group, and FSDP2 CPU offload on a CPU mesh."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from cases_load import MISSING_PATH, _process_group_count, compare_model, mesh_for, reference, tied

import streamload
from streamload.transport import protocol, staging
from streamload.transport.pack import Packer


class FakeEvent:
    """A copy that completes only when the host observes it (the most asynchronous device).

    When observed, it checks that the host slot still holds the bytes the copy was
    issued with: a slot repacked before its copy completed would have changed them.
    """

    def __init__(self, backend: FakeBackend | None = None, slot: int = -1, src: torch.Tensor | None = None):
        self.backend, self.slot = backend, slot
        self.src, self.sent = src, None if src is None else src.clone()
        self.done = backend is None  # compute-stream events: the CPU runs eagerly

    def synchronize(self) -> None:
        if self.done:
            return
        self.done = True
        assert self.backend is not None and self.src is not None and self.sent is not None
        if not torch.equal(self.src, self.sent):
            self.backend.rec["violations"].append(f"slot {self.slot} changed before its copy completed")


class FakeBackend:
    """A device backend for ``staging.Stager`` on the CPU that records how slots are used."""

    LOG: list[dict[str, Any]] = []

    def __init__(self, device: torch.device) -> None:
        self.rec: dict[str, Any] = {
            "slots": 0,
            "copies": 0,
            "overlaps": 0,
            "violations": [],
            "released": False,
        }
        FakeBackend.LOG.append(self.rec)
        self.hosts: list[torch.Tensor] = []
        self.events: list[FakeEvent] = []
        self.last: dict[int, FakeEvent] = {}

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self.hosts.append(torch.empty(nbytes, dtype=torch.uint8))
        self.rec["slots"] += 1
        return self.hosts[-1]

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _slot(self, src: torch.Tensor) -> int:
        for i, h in enumerate(self.hosts):
            if h.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
                return i
        raise AssertionError("copy from memory that is not a host slot")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> FakeEvent:
        slot = self._slot(src)
        prev = self.last.get(slot)
        if prev is not None and not prev.done:
            self.rec["violations"].append(f"slot {slot} repacked while its previous copy was outstanding")
        if not getattr(after, "done", False):
            self.rec["violations"].append(f"copy into device buffer {slot} before its last consumer")
        if any(not e.done for e in self.events):
            self.rec["overlaps"] += 1  # this bucket was packed while an earlier copy was still in flight
        dst.copy_(src)  # the unpack that follows reads it on the host at once
        event = FakeEvent(self, slot, src)
        self.last[slot] = event
        self.events.append(event)
        self.rec["copies"] += 1
        return event

    def compute_waits(self, event: Any) -> None:
        """The compute stream is the host here: nothing to order."""

    def record_compute(self) -> FakeEvent:
        return FakeEvent()

    def synchronize(self) -> None:
        """Nothing runs behind the host's back but the copies, observed through their events."""

    def release(self) -> None:
        self.rec["released"] = True
        self.rec["unobserved"] = sum(not e.done for e in self.events)
        for e in self.events:  # a copy nobody waited for is checked now
            e.synchronize()
        self.hosts.clear()


def case_fake_stager(rank: int, world: int, *, ckpt: str, ws: int, readers: str) -> dict | None:
    """Loads through the staged pipeline (fake device backend) and returns what it saw."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    from streamload.load import prepare

    FakeBackend.LOG.clear()
    staging.BACKENDS["cpu"] = FakeBackend
    # On the CPU, owners loads take one coarse bucket (nothing is staged there); here they stage.
    coarse, prepare.OWNERS_CPU_BUCKET_BYTES = prepare.OWNERS_CPU_BUCKET_BYTES, 0
    try:
        path = ckpt if readers == "owners" or rank == 0 else MISSING_PATH
        model = streamload.from_pretrained(
            path, device_mesh=mesh, bucket_bytes=2048, progress=False, readers=readers, map_files=False
        )
    finally:
        del staging.BACKENDS["cpu"]
        prepare.OWNERS_CPU_BUCKET_BYTES = coarse
    ref = reference(ckpt, None)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    assert tied(model) == tied(ref)
    return {"log": list(FakeBackend.LOG), "buckets": model.streamload_report.buckets}


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
