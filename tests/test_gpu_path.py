"""The GPU path's logic, tested on CPU: slot reuse of the staged pipelines (a fake
device backend), the status flags off the device, the device index, and FSDP2 CPU
offload. What needs CUDA itself is in tests/test_gpu.py (marked gpu)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cases_gpu as cases
import pytest
import torch
from cases_gpu import FakeBackend
from rank_group import RankGroup
from torch import nn

from streamload.model.placement import resolve_device
from streamload.tools.synthetic import make_checkpoint
from streamload.transport import protocol, staging
from streamload.transport.staging import PAGE, CudaBackend, Stager, open_stager, registered_bytes

WORLD = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("gpu_path")
    return str(
        make_checkpoint(
            root / "tied",
            "qwen2",
            tie=True,
            seed=41,
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
def group():
    g = RankGroup(WORLD)
    yield g
    g.close()


SCHEDULES = [("host", False), ("host", True), ("stream", False), ("stream", True)]
# The schedule under which each wait's absence shows (see FakeBackend).
ADVERSARY = {"compute": ("host", False), "slot": ("stream", False), "buffer": ("stream", True)}


def _run_stager(backend: FakeBackend, slots: int, buckets: int = 6) -> list[int]:
    """Stages ``buckets`` buckets of 8 bytes (bucket k holds k + 1) and returns what the consumer
    of each read on the compute stream (a list of the distinct byte values, -1 for mixed)."""
    stager = Stager(slots, 64, backend)
    seen: dict[int, torch.Tensor] = {}
    try:
        for k in range(buckets):
            slot = stager.host(k)
            slot[:8].fill_(k + 1)
            dev = stager.push(k, slot[:8])
            backend.on_compute(lambda k=k, dev=dev: seen.__setitem__(k, dev.clone()))
            stager.consumed(k)
    finally:
        stager.close()
    return [int(seen[k][0]) if bool((seen[k] == seen[k][0]).all()) else -1 for k in range(buckets)]


@pytest.mark.parametrize("compute,eager", SCHEDULES)
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_stager_delivers_every_bucket_on_an_asynchronous_device(
    compute: str, eager: bool, slots: int
) -> None:
    backend = FakeBackend(torch.device("cpu"), compute=compute, eager=eager)
    assert _run_stager(backend, slots) == [1, 2, 3, 4, 5, 6]
    rec = backend.rec
    assert rec["violations"] == [] and rec["copies"] == 6 and rec["compute_waits"] == 6, rec
    assert rec["released"] and rec["unobserved"] == 0 and backend.hosts == []


@pytest.mark.parametrize("skip", cases.SKIPS)
def test_each_wait_of_the_stager_is_needed(skip: str) -> None:
    """Without any one of its waits, a Stager hands some consumer the wrong bytes."""
    compute, eager = ADVERSARY[skip]
    with cases.skipping(skip):
        got = _run_stager(FakeBackend(torch.device("cpu"), compute=compute, eager=eager), slots=2)
    assert got != [1, 2, 3, 4, 5, 6], (skip, got)
    # The same schedule with the wait in place is exact (above, for every schedule).
    backend = FakeBackend(torch.device("cpu"), compute=compute, eager=eager)
    assert _run_stager(backend, slots=2) == [1, 2, 3, 4, 5, 6]


def test_stager_waits_for_its_own_slot_only() -> None:
    backend = FakeBackend(torch.device("cpu"), compute="stream")
    assert _run_stager(backend, 2) == [1, 2, 3, 4, 5, 6]
    rec = backend.rec
    assert rec["violations"] == [] and rec["copies"] == 6
    # Bucket k was packed while bucket k-1's copy had not run yet (all but the first).
    assert rec["overlaps"] == 5


def test_one_slot_cannot_overlap_and_the_fake_sees_a_slot_repacked_too_early() -> None:
    backend = FakeBackend(torch.device("cpu"), compute="stream")
    assert _run_stager(backend, 1, buckets=3) == [1, 2, 3]
    assert backend.rec["overlaps"] == 0 and backend.rec["violations"] == []
    # A pipeline that packs into a slot without waiting for its copy is caught.
    bad = FakeBackend(torch.device("cpu"), compute="stream")
    stager = Stager(2, 64, bad)
    stager.push(0, stager.hosts[0][:8])
    stager.consumed(0)
    stager.hosts[0][:8].fill_(7)  # repacked: no host(2) first
    stager.push(2, stager.hosts[0][:8])
    assert any("repacked" in v for v in bad.rec["violations"]), bad.rec
    stager.close()
    assert any("changed before its copy completed" in v for v in bad.rec["violations"]), bad.rec


def test_fake_device_waits_really_wait() -> None:
    """An event completes only when the worker reaches it, in submission order."""
    stream = cases.FakeStream("t")
    order: list[int] = []
    stream.submit(lambda: order.append(0))
    first = stream.record()
    stream.submit(lambda: order.append(1))
    second = stream.record()
    assert not first.done and order == []  # lazy: nobody asked yet
    second.synchronize()
    assert first.done and order == [0, 1]
    blocker = threading.Event()
    eager = cases.FakeStream("e", eager=True)
    eager.submit(lambda: blocker.wait(10))
    late = eager.record()
    assert not late.done  # the worker is stuck on the op before it
    blocker.set()
    late.synchronize()
    assert late.done
    stream.close()
    eager.close()


def test_stager_refuses_to_overwrite_an_unconsumed_device_buffer() -> None:
    stager = Stager(2, 64, FakeBackend(torch.device("cpu")))
    stager.push(0, stager.host(0)[:4])
    stager.push(1, stager.host(1)[:4])
    with pytest.raises(AssertionError, match="reused before bucket 0 was consumed"):
        stager.push(2, stager.host(2)[:4])
    stager.consumed(1)
    with pytest.raises(AssertionError, match="not packed into its host slot"):
        stager.push(3, torch.zeros(4, dtype=torch.uint8))


class FakeCuda:
    """The torch.cuda entry points CudaBackend uses, on the CPU: each call records the
    device that is current when it is made (what the CUDA runtime would act on)."""

    def __init__(self, current: int = 0) -> None:
        self.current = current
        self.calls: list[tuple[str, int]] = []
        self.register_error = 0

    def _note(self, what: str) -> None:
        self.calls.append((what, self.current))

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        prev, self.current = self.current, torch.device(device).index
        try:
            yield
        finally:
            self.current = prev

    def cudart(self) -> FakeCuda:
        return self

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self._note("cudaHostRegister")
        return self.register_error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - CUDA's name
        self._note("cudaHostUnregister")
        return 0

    def Stream(self, device: Any = None) -> SimpleNamespace:  # noqa: N802 - torch's name
        self._note("Stream")
        return self._stream()

    def current_stream(self, device: Any = None) -> SimpleNamespace:
        self._note("current_stream")
        return self._stream()

    def _stream(self) -> SimpleNamespace:
        return SimpleNamespace(
            wait_event=lambda event: self._note("wait_event"), synchronize=lambda: self._note("synchronize")
        )

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        self._note("stream")
        yield

    def Event(self) -> SimpleNamespace:  # noqa: N802 - torch's name
        self._note("Event")
        return SimpleNamespace(
            record=lambda stream=None: self._note("record"), synchronize=lambda: self._note("event sync")
        )


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """torch.cuda faked on the CPU, the current device 0; CudaBackend's device buffers on the CPU."""
    fake = FakeCuda(current=0)
    for name in ("device", "cudart", "Stream", "current_stream", "stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(CudaBackend, "device_buffer", lambda self, n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(staging, "_launch", lambda device: fake._note("launch"))
    return fake


def test_cuda_backend_runs_on_the_load_device_not_the_current_one(fake_cuda: FakeCuda) -> None:
    """Registering, unregistering, streams and events all act on the load device (cuda:3)
    while the caller's current device is 0: none may create a context on GPU 0."""
    backend = CudaBackend(torch.device("cuda", 3))
    stager = Stager(2, 4096, backend)
    for k in range(4):
        slot = stager.host(k)
        slot[:8].fill_(k)
        stager.push(k, slot[:8])
        stager.consumed(k)
    stager.close()
    assert registered_bytes() == 0
    kinds = {what for what, _ in fake_cuda.calls}
    assert {"cudaHostRegister", "cudaHostUnregister", "Stream", "Event", "record", "wait_event"} <= kinds
    assert [c for c in fake_cuda.calls if c[1] != 3] == []
    assert fake_cuda.current == 0  # the caller's current device is put back


def test_host_slots_are_page_locked_and_given_back(fake_cuda: FakeCuda) -> None:
    backend = CudaBackend(torch.device("cuda", 1))
    bufs = [backend.host_buffer(n) for n in (5000, 1 << 20, 0)]
    assert [b.numel() for b in bufs] == [5000, 1 << 20, 0]
    assert all(b.data_ptr() % PAGE == 0 for b in bufs[:2])
    assert registered_bytes() == 5000 + (1 << 20)
    backend.release()
    assert registered_bytes() == 0
    ops = [what for what, _ in fake_cuda.calls]
    assert ops.count("cudaHostRegister") == 2 and ops.count("cudaHostUnregister") == 2
    fake_cuda.register_error = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        backend.host_buffer(4096)
    assert registered_bytes() == 0


def test_a_stager_that_fails_to_allocate_releases_what_it_had() -> None:
    class Failing(FakeBackend):
        def host_buffer(self, nbytes: int) -> torch.Tensor:
            if self.rec["slots"] == 1:
                raise RuntimeError("cudaHostRegister failed")
            return super().host_buffer(nbytes)

    backend = Failing(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        Stager(2, 64, backend)
    assert backend.rec["released"] and backend.hosts == []


def test_cpu_pipelines_do_not_stage() -> None:
    assert open_stager(torch.device("cpu"), 2, 64) is None


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("readers,ws", [("owners", 2), ("owners", 3), ("src", 3)])
def test_staged_pipeline_loads_exactly_on_an_asynchronous_device(
    group: RankGroup, ckpt: str, readers: str, ws: int, eager: bool
) -> None:
    res = group.run(cases.case_fake_stager, ckpt=ckpt, ws=ws, readers=readers, eager=eager)
    assert all(r["bad"] == [] for r in res[:ws]), res
    stagers = [rec for r in res[:ws] for rec in r["log"]]
    # owners: every rank stages its own buckets; src: the reader alone.
    assert len(stagers) == (ws if readers == "owners" else 1), stagers
    for rec in stagers:
        assert rec["slots"] >= 2, rec
        assert rec["violations"] == [], rec
        # Every staged bucket's consumer waited for its copy (the compute stream is the host here).
        assert rec["copies"] > 2 and rec["compute_waits"] == rec["copies"], rec
        assert rec["released"] and rec["unobserved"] == 0, rec


@pytest.mark.parametrize("readers,ws", [("owners", 2), ("src", 3)])
def test_staged_pipeline_without_the_copy_wait_loads_wrong_bytes(
    group: RankGroup, ckpt: str, readers: str, ws: int
) -> None:
    """The fake device is asynchronous enough to matter: with the compute stream's wait for
    each copy taken out of the staging code, the loaded parameters differ."""
    res = group.run(cases.case_fake_stager, ckpt=ckpt, ws=ws, readers=readers, skip="compute")
    assert all(r["bad"] for r in res[:ws]), [r["bad"] for r in res[:ws]]


@pytest.mark.parametrize("readers,ws,fail", [("owners", 3, 1), ("src", 3, 0)])
def test_staging_that_fails_to_allocate_on_one_rank_raises_on_every_rank(
    group: RankGroup, ckpt: str, readers: str, ws: int, fail: int
) -> None:
    res = group.run(cases.case_staging_alloc_fails, ckpt=ckpt, ws=ws, readers=readers, fail=fail)
    for r in res[:ws]:
        assert r is not None and r != "loaded", res
        assert "cudaHostRegister refused" in r, res


def test_status_flags_on_a_side_group_per_load(group: RankGroup, ckpt: str) -> None:
    res = group.run(cases.case_side_group, ckpt=ckpt, loads=3)
    for r in res:
        # One gloo group per load (4 loads, the last one failing), none left behind.
        assert r["gloo_groups"] == 4, r
        assert r["counts"] == [r["before"]] * 4, r
        assert r["errors"] == [("CheckpointFileError", 1)], r


def test_status_route_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol.dist, "get_backend", lambda group=None: group)
    assert protocol.carries_cpu("cpu:gloo,cuda:nccl") and protocol.carries_cpu("gloo")
    assert not protocol.carries_cpu("nccl")
    cuda = torch.device("cuda", 0)
    assert protocol.needs_side_group("nccl", cuda)
    assert not protocol.needs_side_group("cpu:gloo,cuda:nccl", cuda)
    assert not protocol.needs_side_group("gloo", torch.device("cpu"))
    # Over part of an NCCL-only world no group is created: device flags, never a hang.
    monkeypatch.setattr(protocol.dist, "get_world_size", lambda group=None: 2 if group == "nccl" else 4)
    route = protocol.open_status_route("nccl", cuda)  # type: ignore[arg-type]
    assert route.group == "nccl" and route.device == cuda and not route.owned
    route = protocol.open_status_route("cpu:gloo,cuda:nccl", cuda)  # type: ignore[arg-type]
    assert route.device == torch.device("cpu") and not route.owned


class _Holder(nn.Module):
    """A model whose tensors claim to live on given devices (no CUDA needed)."""

    def __init__(self, devices: list[torch.device]) -> None:
        super().__init__()
        self.fake = [SimpleNamespace(device=d, is_meta=d.type == "meta") for d in devices]

    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        return iter(self.fake)

    def buffers(self, recurse: bool = True) -> Any:  # type: ignore[override]
        return iter([])


def test_device_index_comes_from_the_model_not_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    mesh = SimpleNamespace(device_type="cuda")
    held = _Holder([torch.device("cpu"), torch.device("cuda", 3)])  # e.g. offloaded params, a cuda buffer
    assert resolve_device(held, mesh, None) == torch.device("cuda", 3)
    assert resolve_device(_Holder([torch.device("cuda", 2)]), None, None) == torch.device("cuda", 2)
    meta = _Holder([torch.device("meta")])
    bound = SimpleNamespace(bound_device_id=torch.device("cuda", 5))
    assert resolve_device(meta, mesh, bound) == torch.device("cuda", 5)  # type: ignore[arg-type]
    # Nothing else to go by: the current device, which is what fully_shard recorded.
    assert resolve_device(meta, mesh, None) == torch.device("cuda", 0)
    assert resolve_device(meta, SimpleNamespace(device_type="cpu"), None) == torch.device("cpu")


@pytest.mark.parametrize("readers,ws", [("src", 3), ("owners", 2), ("owners", 3)])
def test_load_into_fsdp2_cpu_offload_model(group: RankGroup, ckpt: str, readers: str, ws: int) -> None:
    res = group.run(cases.case_offload, ckpt=ckpt, ws=ws, readers=readers)
    assert all(r["devices"] == ["cpu"] for r in res[:ws]), res


def test_verl_cpu_offload_into_offload_model(group: RankGroup, ckpt: str) -> None:
    res = group.run(cases.case_offload, ckpt=ckpt, ws=3, readers="src", verl=True)
    assert all(r["devices"] == ["cpu"] for r in res), res


def test_offload_materialisation_splits_params_and_buffers(group: RankGroup, ckpt: str) -> None:
    # Also the guard on FSDP2's private offload state: it fails here if torch renames it.
    res = group.run(cases.case_offload_placement, ckpt=ckpt)
    for r in res:
        assert r["params"] == {"DTensor": "cpu"}, r
        assert r["buffers"] == ["meta"], r
        assert r["detects"] is False, r


def test_meta_model_is_materialised_where_fully_shard_recorded(group: RankGroup, ckpt: str) -> None:
    res = group.run(cases.case_fsdp_device, ckpt=ckpt)
    for rank, r in enumerate(res):
        assert r["recorded"] == "cpu", r  # fails loudly if torch renames FSDP2's recorded device
        assert r["resolved"] == "cuda:2", r  # not current_device() (0)
        assert r["resolved_bound"] == "cuda:5", r  # collectives on the bound device ...
        assert "fully_shard recorded cuda:2" in r["check"] and "runs on cuda:5" in r["check"], (
            r
        )  # ... refused
        assert r["load"] != "loaded" and r["load_s"] < 60, r
        if rank == 1:
            assert r["load"].startswith("PlacementError") and "fully_shard recorded cuda:1" in r["load"], r


def test_save_agreements_on_a_side_group_per_save(group: RankGroup, ckpt: str, tmp_path: Path) -> None:
    """On an NCCL-only group the save's agreements ride a gloo twin (a dead rank is noticed by
    the store watch instead of NCCL's watchdog): forced here on gloo ranks."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    res = group.run(cases.case_save_side_group, ckpt=ckpt, out=str(out))
    for r in res:
        assert r["gloo_groups"] == 3 and r["counts"] == [r["before"]] * 3, r  # one twin per save, none left
        assert r["on_world"] == [], r  # no agreement on the group itself
        assert r["errors"] == [("SaveError", 1)], r
    a, b = (
        load_file(tmp_path / "out-owners" / "model.safetensors"),
        load_file(tmp_path / "out-src" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "out-fails").exists()
    assert not [p for p in tmp_path.iterdir() if ".streamload-" in p.name]


def _tree(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("eager", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["lazy", "eager"])
def test_save_of_device_shards_stages_through_host_slots(
    group: RankGroup, ckpt: str, tmp_path: Path, eager: bool
) -> None:
    """A save of device shards reads every piece into two host slots through the device's copy
    stream (the fake: copies run only when waited for, or at once) and writes exactly what the
    unstaged save writes: owners, src, a bf16 cast and fp8 (cast and quantized on the host)."""
    out = tmp_path / "out"
    res = group.run(cases.case_fake_save, ckpt=ckpt, out=str(out), eager=eager)
    for name in ("owners", "src", "bf16", "fp8"):
        assert _tree(tmp_path / f"out-{name}") == _tree(tmp_path / f"out-ref-{name}"), name
    for r in res:
        logs = r["log"]
        assert len(logs) == 4 * 1 and all(x["released"] and x["slots"] == 2 for x in logs), logs
        assert all(x.get("downloads", 0) > 0 and x["violations"] == [] for x in logs), logs


def test_save_that_reads_a_slot_before_its_copy_writes_wrong_bytes(
    group: RankGroup, ckpt: str, tmp_path: Path
) -> None:
    """The wait is needed: a slot handed out before its copy ran holds the previous piece (or
    the fake's poison), and the files differ from the unstaged save's."""
    out = tmp_path / "out"
    group.run(cases.case_fake_save, ckpt=ckpt, out=str(out), eager=False, skip_wait=True)
    assert _tree(tmp_path / "out-owners") != _tree(tmp_path / "out-ref-owners")
