"""The GPU path's failures, on CPU through fake devices: page-locking refused (pageable
staging, reported and warned about), the CUDA error a failed ``cudaHostRegister`` leaves
pending, and a device that faults mid-stream; each at 2 and 3 gloo ranks, with the error
agreements on the gloo side group (see cases_gpu_faults.py for what the fakes stand in for)."""

from __future__ import annotations

import warnings

import cases_gpu_faults as cases
import pytest
import torch
from cases_gpu import FakeBackend, case_fake_stager
from cases_gpu_faults import FaultyCuda, RefusingBackend
from rank_group import RankGroup

from streamload.tools.synthetic import make_checkpoint
from streamload.transport.staging import CudaBackend, PageLockRefused, Stager, registered_bytes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("gpu_faults")
    return str(
        make_checkpoint(
            root / "tied",
            "qwen2",
            tie=True,
            seed=43,
            layers=2,
            vocab=61,
            hidden_size=24,
            intermediate_size=38,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_shard_size="8KB",
        )
    )


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def group(request: pytest.FixtureRequest):
    """A gloo group over the whole world (the side group is made only for a world-wide load)."""
    g = RankGroup(request.param)
    yield g
    g.close()


def _stage(stager: Stager, backend: object, buckets: int = 6) -> list[int]:
    """Stages buckets of 8 bytes (bucket k holds k + 1); what each consumer read (-1: mixed)."""
    seen: dict[int, torch.Tensor] = {}
    on_compute = getattr(backend, "on_compute", lambda fn: fn())
    try:
        for k in range(buckets):
            slot = stager.host(k)
            slot[:8].fill_(k + 1)
            dev = stager.push(k, slot[:8])
            on_compute(lambda k=k, dev=dev: seen.__setitem__(k, dev.clone()))
            stager.consumed(k)
    finally:
        stager.close()
    return [int(seen[k][0]) if bool((seen[k] == seen[k][0]).all()) else -1 for k in range(buckets)]


# -- one process -------------------------------------------------------------------------


def test_a_refused_register_leaves_no_cuda_error_pending() -> None:
    """torch's cudaHostRegister binding returns the code and leaves it as the last error: the
    backend reads it back (a launch), finds the device well (a second launch) and says refused."""
    cuda = FaultyCuda(register_error=2)
    with cuda.installed():
        backend = CudaBackend(torch.device("cuda", 0))
        with pytest.raises(PageLockRefused, match="cudaError 2") as refused:
            backend.host_buffer(4096)
        assert refused.value.code == 2
        assert not cuda.pending() and cuda.launches == 2
        assert backend.host_buffer(4096, lock=False).numel() == 4096  # pageable: no register
        backend.release()
    assert registered_bytes() == 0 and cuda.registered == 0


def test_a_register_on_a_faulted_device_raises_the_fault() -> None:
    cuda = FaultyCuda(register_error=700, sticky=True)
    with cuda.installed():
        backend = CudaBackend(torch.device("cuda", 0))
        with pytest.raises(RuntimeError, match="on a device that faulted") as raised:
            backend.host_buffer(4096)
        assert not isinstance(raised.value, PageLockRefused)
    assert registered_bytes() == 0


def test_stager_falls_back_to_pageable_slots_on_cuda_backend() -> None:
    cuda = FaultyCuda(register_error=2)
    with cuda.installed():
        with pytest.warns(UserWarning, match="2 of 2 staging slots are pageable"):
            stager = Stager(2, 64, CudaBackend(torch.device("cuda", 0)))
        assert stager.staging == "pageable" and stager.locked == [False, False]
        assert _stage(stager, stager.backend) == [1, 2, 3, 4, 5, 6]
    assert registered_bytes() == 0 and not cuda.pending()


@pytest.mark.parametrize("eager", [False, True])
def test_stager_falls_back_to_pageable_slots_on_an_asynchronous_device(eager: bool) -> None:
    """Slot 0 page-locked, slot 1 refused: its copies are synchronous, every consumer (on a
    compute stream of its own) reads its bucket's bytes, and no slot is repacked too early."""
    backend = RefusingBackend(torch.device("cpu"), compute="stream", eager=eager)
    with pytest.warns(UserWarning, match="1 of 2 staging slots are pageable"):
        stager = Stager(2, 64, backend)
    assert stager.locked == [True, False] and stager.staging == "pageable"
    assert _stage(stager, backend) == [1, 2, 3, 4, 5, 6]
    assert backend.rec["violations"] == [] and backend.rec["unobserved"] == 0, backend.rec
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing refused: no warning
        assert Stager(2, 64, FakeBackend(torch.device("cpu"))).staging == "pinned"


# -- ranks -----------------------------------------------------------------------------


@pytest.mark.parametrize("readers,refuse", [("owners", 1), ("src", 0)])
def test_refused_page_locking_falls_back_on_that_rank(
    group: RankGroup, ckpt: str, readers: str, refuse: int
) -> None:
    """cudaHostRegister refused on one rank (the real CudaBackend on a fake runtime): every
    rank loads exactly, that rank stages through pageable memory, says so in its report and
    a warning, and leaves no CUDA error pending for the caller's next kernel."""
    res = group.run(cases.case_refused, ckpt=ckpt, readers=readers, refuse=refuse, backend="cuda")
    for rank, r in enumerate(res):
        assert r["error"] is None and r["bad"] == [] and r["tied"], (rank, r)
        assert not r["pending"] and r["on_device"] == [], (rank, r)
        stages = readers == "owners" or rank == 0
        assert r["staging"] == ("pageable" if rank == refuse else "pinned" if stages else ""), (rank, r)
        assert len(r["warnings"]) == (rank == refuse), (rank, r)


@pytest.mark.parametrize(
    "readers,refuse,compute,eager",
    [("owners", 1, "stream", False), ("owners", 1, "stream", True), ("src", 0, "host", False)],
)
def test_refused_page_locking_on_the_asynchronous_fake_device(
    group: RankGroup, ckpt: str, readers: str, refuse: int, compute: str, eager: bool
) -> None:
    res = group.run(
        cases.case_refused, ckpt=ckpt, readers=readers, refuse=refuse, backend="fake", compute=compute,
        eager=eager,
    )  # fmt: skip
    for rank, r in enumerate(res):
        assert r["error"] is None and r["bad"] == [] and r["tied"], (rank, r)
        stages = readers == "owners" or rank == 0
        assert r["staging"] == ("pageable" if rank == refuse else "pinned" if stages else ""), (rank, r)
        assert len(r["warnings"]) == (rank == refuse), (rank, r)
        assert "1 of" in "".join(r["warnings"]) or rank != refuse, r  # slot 0 stayed page-locked


@pytest.mark.parametrize("eager", [False, True])
def test_owners_pipeline_unpacks_on_the_compute_stream(group: RankGroup, ckpt: str, eager: bool) -> None:
    """The fake's compute stream is a worker of its own: every event recorded there completes
    only once the unpack queued before it ran, and the loaded bytes are still exact."""
    res = group.run(
        case_fake_stager, ckpt=ckpt, ws=group.world, readers="owners", eager=eager, compute="stream"
    )
    for r in res:
        assert r["bad"] == [], r
        (rec,) = r["log"]
        assert rec["violations"] == [] and rec["copies"] > 2 and rec["compute_waits"] == rec["copies"], rec
        assert rec["released"] and rec["unobserved"] == 0, rec


def _one_error_naming(res: list[dict], fail: int, text: str) -> None:
    for rank, r in enumerate(res):
        assert r["error"] is not None and text in r["error"], (rank, r)
        if rank != fail:
            assert r["error"].startswith("RemoteRankError") and r["rank_named"] == fail, (rank, r)
        # The error agreements ran on the side group; none was tried on the device.
        assert r["on_device"] == [] and r["on_side"] > 0, (rank, r)
        assert r["seconds"] < 30, (rank, r)


@pytest.mark.parametrize("readers,fail", [("owners", 1), ("src", 0)])
def test_register_on_a_faulted_device_is_one_error_on_every_rank(
    group: RankGroup, ckpt: str, readers: str, fail: int
) -> None:
    res = group.run(cases.case_device_fault, ckpt=ckpt, readers=readers, fail=fail, sticky_register=True)
    _one_error_naming(res, fail, "cudaError 700")


@pytest.mark.parametrize(
    "readers,fail,at,compute",
    [("owners", 1, "mid", "stream"), ("owners", 1, "last", "stream"), ("src", 0, "mid", "host")],
)
def test_a_device_fault_mid_stream_is_one_error_on_every_rank(
    group: RankGroup, ckpt: str, readers: str, fail: int, at: str, compute: str
) -> None:
    """A copy on one rank's fake device faults (sticky): every rank raises, the others name
    that rank, and the agreement never asks the faulted device (on NCCL: a hang)."""
    res = group.run(cases.case_device_fault, ckpt=ckpt, readers=readers, fail=fail, at=at, compute=compute)
    assert res[fail]["copies"] > 2, res[fail]
    _one_error_naming(res, fail, "fake stream")


# -- a real device (skipped without CUDA) ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_failed_register_leaves_no_error_for_the_next_kernel_on_a_gpu() -> None:
    """A cudaHostRegister that fails (invalid flags) leaves its error set; once read back, the
    next kernel runs and the device is well."""
    from streamload.transport.staging import clear_last_error

    device = torch.device("cuda", torch.cuda.current_device())
    buf = torch.empty(1 << 16, dtype=torch.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0xFF)) != 0
    clear_last_error(device)
    assert int(torch.ones(4, device=device).sum().item()) == 4
    torch.cuda.synchronize(device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pageable_staging_delivers_every_bucket_on_a_gpu() -> None:
    class Refusing(CudaBackend):
        def host_buffer(self, nbytes: int, lock: bool = True) -> torch.Tensor:
            if lock:
                raise PageLockRefused(2, nbytes)
            return super().host_buffer(nbytes, lock=False)

    device = torch.device("cuda", torch.cuda.current_device())
    with pytest.warns(UserWarning, match="pageable"):
        stager = Stager(2, 1 << 20, Refusing(device))
    assert _stage(stager, stager.backend) == [1, 2, 3, 4, 5, 6]
    assert registered_bytes() == 0
