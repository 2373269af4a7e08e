"""The GPU path's logic, tested on CPU: slot reuse of the staged pipelines (a fake
device backend), the status flags off the device, the device index, and FSDP2 CPU
offload. What needs CUDA itself is in tests/test_gpu.py (marked gpu)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import cases_gpu as cases
import pytest
import torch
from cases_gpu import FakeBackend
from rank_group import RankGroup
from torch import nn

from streamload.load.source import resolve_device
from streamload.tools.synthetic import make_checkpoint
from streamload.transport import protocol
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


def _stage(stager: Stager, k: int, fill: int) -> torch.Tensor:
    slot = stager.host(k)
    slot[:8].fill_(fill)
    dev = stager.push(k, slot[:8])
    stager.consumed(k)
    return dev


def test_stager_waits_for_its_own_slot_only() -> None:
    backend = FakeBackend(torch.device("cpu"))
    stager = Stager(2, 64, backend)
    for k in range(6):
        assert torch.equal(_stage(stager, k, k + 1), torch.full((8,), k + 1, dtype=torch.uint8))
    rec = backend.rec
    assert rec["violations"] == [] and rec["copies"] == 6
    # Bucket k was packed while bucket k-1's copy was still in flight (all but the first).
    assert rec["overlaps"] == 5
    stager.close()
    assert rec["released"] and rec["unobserved"] == 0 and stager.hosts == []


def test_one_slot_cannot_overlap_and_the_fake_sees_a_slot_repacked_too_early() -> None:
    backend = FakeBackend(torch.device("cpu"))
    stager = Stager(1, 64, backend)
    for k in range(3):
        _stage(stager, k, k)
    assert backend.rec["overlaps"] == 0 and backend.rec["violations"] == []
    # A pipeline that packs into a slot without waiting for its copy is caught.
    bad = FakeBackend(torch.device("cpu"))
    stager = Stager(2, 64, bad)
    stager.push(0, stager.hosts[0][:8])
    stager.consumed(0)
    stager.hosts[0][:8].fill_(7)  # repacked: no host(2) first
    stager.push(2, stager.hosts[0][:8])
    assert any("repacked" in v for v in bad.rec["violations"]), bad.rec
    stager.close()
    assert any("changed before its copy completed" in v for v in bad.rec["violations"]), bad.rec


def test_stager_refuses_to_overwrite_an_unconsumed_device_buffer() -> None:
    stager = Stager(2, 64, FakeBackend(torch.device("cpu")))
    stager.push(0, stager.host(0)[:4])
    stager.push(1, stager.host(1)[:4])
    with pytest.raises(AssertionError, match="reused before bucket 0 was consumed"):
        stager.push(2, stager.host(2)[:4])
    stager.consumed(1)
    with pytest.raises(AssertionError, match="not packed into its host slot"):
        stager.push(3, torch.zeros(4, dtype=torch.uint8))


def test_host_slots_are_page_locked_and_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    fake = SimpleNamespace(
        cudaHostRegister=lambda ptr, n, flags: calls.append(("register", ptr)) or 0,
        cudaHostUnregister=lambda ptr: calls.append(("unregister", ptr)) or 0,
    )
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    backend = CudaBackend.__new__(CudaBackend)  # no stream: only the host side is exercised
    backend._registered = []
    bufs = [backend.host_buffer(n) for n in (5000, 1 << 20, 0)]
    assert [b.numel() for b in bufs] == [5000, 1 << 20, 0]
    assert all(b.data_ptr() % PAGE == 0 for b in bufs[:2])
    assert registered_bytes() == 5000 + (1 << 20)
    backend.release()
    assert registered_bytes() == 0
    registered = sorted(p for op, p in calls if op == "register")
    assert len(registered) == 2 and registered == sorted(p for op, p in calls if op == "unregister")
    fake.cudaHostRegister = lambda ptr, n, flags: 2  # cudaErrorMemoryAllocation
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


@pytest.mark.parametrize("readers,ws", [("owners", 2), ("owners", 3), ("src", 3)])
def test_staged_pipeline_reuses_no_slot_early(group: RankGroup, ckpt: str, readers: str, ws: int) -> None:
    res = group.run(cases.case_fake_stager, ckpt=ckpt, ws=ws, readers=readers)
    stagers = [rec for r in res[:ws] for rec in r["log"]]
    # owners: every rank stages its own buckets; src: the reader alone.
    assert len(stagers) == (ws if readers == "owners" else 1), stagers
    for rec in stagers:
        assert rec["slots"] >= 2, rec
        assert rec["violations"] == [], rec
        assert rec["copies"] > 2 and rec["overlaps"] >= rec["copies"] - 1, rec
        assert rec["released"] and rec["unobserved"] == 0, rec


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
