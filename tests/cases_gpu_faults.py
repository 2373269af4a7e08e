"""Rank-group cases for the GPU path's failures, on CPU ranks through fake devices (see
rank_group.py and cases_gpu.py): page-locking refused (pageable staging), the CUDA error a
failed ``cudaHostRegister`` leaves set, and a device that faults in the middle of the stream.

Every case runs over the whole world with the status flags forced onto a gloo side group, as
on an NCCL-only group. ``DeviceAgreements`` stands in for NCCL where it matters: a rank whose
device faulted (or that still has a CUDA error pending, which its next kernel launch would
raise) cannot take part in an agreement over the load's own group, so such an agreement raises
there before the rank joins it, as the launch of the agreement's kernels would on a GPU.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from cases_gpu import FakeBackend
from cases_load import MISSING_PATH, compare_model, mesh_for, reference, tied

import streamload
from streamload.transport import protocol, staging

FAULT = "CUDA error: an illegal memory access was encountered (simulated device fault)"


class _Stream:
    """A CUDA stream that does nothing (a class, not a function: modules that torch imports
    lazily evaluate ``torch.cuda.Stream | None`` in their signatures)."""

    def __init__(self, device: Any = None) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event:
    """A CUDA event that is always complete (``CudaBackend``'s copies run on the CPU, synchronously)."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FaultyCuda:
    """The torch.cuda entry points ``CudaBackend`` uses, on the CPU, with the runtime's error state.

    - ``cudaHostRegister`` fails with ``register_error`` (when set) and, as the real runtime
      does, leaves that error as the thread's last error; with ``sticky`` the device has
      faulted: every later launch fails with it, and nothing clears it.
    - ``launch`` is a kernel launch as torch checks it: it raises the pending last error and
      resets it (``cudaGetLastError``), or the sticky fault.
    - torch 2.13's ``cudart()`` binds no ``cudaGetLastError``; nor does this fake.
    """

    ATTRS = ("device", "cudart", "Stream", "current_stream", "stream", "Event")

    def __init__(self, register_error: int = 0, sticky: bool = False) -> None:
        self.register_error = register_error
        self.sticky_on_register = sticky
        self.last_error = 0
        self.sticky = 0
        self.launches = 0
        self.registered = 0

    def pending(self) -> bool:
        """Whether the next kernel launch on this rank would raise."""
        return bool(self.last_error or self.sticky)

    def launch(self, device: Any = None) -> None:
        self.launches += 1
        if self.sticky:
            raise RuntimeError(f"CUDA error: cudaError {self.sticky} (sticky)")
        err, self.last_error = self.last_error, 0
        if err:
            raise RuntimeError(f"CUDA error: cudaError {err}")

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        yield

    def cudart(self) -> FaultyCuda:
        return self

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        if self.register_error:
            self.last_error = self.register_error
            if self.sticky_on_register:
                self.sticky = self.register_error
            return self.register_error
        self.registered += 1
        return self.sticky

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - CUDA's name
        self.registered -= 1
        return self.sticky

    Stream = _Stream
    Event = _Event

    def current_stream(self, device: Any = None) -> _Stream:
        return _Stream()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def installed(self) -> Iterator[FaultyCuda]:
        """torch.cuda's entry points and the launch of ``staging`` replaced by this fake; the
        CPU stages through ``CudaBackend`` (its device buffers on the CPU)."""
        saved = {name: getattr(torch.cuda, name) for name in self.ATTRS}
        real_launch, real_buffer = staging._launch, staging.CudaBackend.device_buffer
        for name in self.ATTRS:
            setattr(torch.cuda, name, getattr(self, name))
        staging._launch = self.launch
        staging.CudaBackend.device_buffer = lambda _, n: torch.empty(n, dtype=torch.uint8)  # type: ignore[method-assign]
        staging.BACKENDS["cpu"] = staging.CudaBackend
        try:
            yield self
        finally:
            del staging.BACKENDS["cpu"]
            staging._launch = real_launch
            staging.CudaBackend.device_buffer = real_buffer  # type: ignore[method-assign]
            for name, value in saved.items():
                setattr(torch.cuda, name, value)


class DeviceAgreements:
    """Forces the status route onto a gloo side group and watches the agreements.

    ``faulted()`` says whether this rank's device can launch nothing (a fault, or an error
    pending for the next launch); an agreement over a group that is not a side group then
    raises on this rank before it joins, as NCCL's kernels would. ``on_device`` lists those.
    """

    def __init__(self, faulted: Callable[[], bool]) -> None:
        self.faulted = faulted
        self.side: list[Any] = []
        self.on_device: list[str] = []
        self.on_side = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[DeviceAgreements]:
        real_needs, real_new_group, real_gather = (
            protocol.needs_side_group,
            dist.new_group,
            protocol.all_gather_object,
        )

        def new_group(*args: Any, **kwargs: Any) -> Any:
            g = real_new_group(*args, **kwargs)
            if kwargs.get("backend") == "gloo":
                self.side.append(g)
            return g

        def gather(obj: Any, group: Any, device: Any) -> Any:
            if any(group is g for g in self.side):
                self.on_side += 1
            elif self.faulted():
                self.on_device.append(type(obj).__name__)
                raise RuntimeError(f"{FAULT}: launching the agreement's kernels")
            return real_gather(obj, group, device)

        protocol.needs_side_group = lambda group, device: True
        dist.new_group = new_group
        protocol.all_gather_object = gather
        try:
            yield self
        finally:
            protocol.needs_side_group, dist.new_group = real_needs, real_new_group
            protocol.all_gather_object = real_gather


class RefusingBackend(FakeBackend):
    """The asynchronous fake device, refusing to page-lock slots from ``FROM_SLOT`` on."""

    FROM_SLOT = 1

    def host_buffer(self, nbytes: int, lock: bool = True) -> torch.Tensor:
        if lock and len(self.hosts) >= self.FROM_SLOT:
            raise staging.PageLockRefused(2, nbytes)
        return super().host_buffer(nbytes, lock)


class FaultingBackend(FakeBackend):
    """The asynchronous fake device, whose copy number ``FAIL_AT`` faults on the copy stream
    (every wait on that stream raises from then on, and so does every compute-stream op that
    waits for one of its copies)."""

    FAIL_AT: int | None = None
    FAULTED = {"now": False}

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        if self.rec["copies"] == self.FAIL_AT:

            def fault() -> None:
                FaultingBackend.FAULTED["now"] = True
                raise RuntimeError(FAULT)

            self.stream.submit(fault)
        return super().copy(dst, src, after)


def _load(ckpt: str, rank: int, readers: str) -> Any:
    from streamload.load import prepare

    # On the CPU, owners loads take one coarse bucket (nothing is staged there); here they stage.
    coarse, prepare.OWNERS_CPU_BUCKET_BYTES = prepare.OWNERS_CPU_BUCKET_BYTES, 0
    try:
        path = ckpt if readers == "owners" or rank == 0 else MISSING_PATH
        return streamload.from_pretrained(
            path, device_mesh=mesh_for(dist.get_world_size()), bucket_bytes=2048, progress=False,
            readers=readers, map_files=False,
        )  # fmt: skip
    finally:
        prepare.OWNERS_CPU_BUCKET_BYTES = coarse


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """Runs ``fn``; what it returned or raised, how long it took, and the warnings it gave."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"error": None, "rank_named": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out["model"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["rank_named"] = getattr(exc, "rank", None)
    out["seconds"] = time.perf_counter() - t0
    out["warnings"] = [str(w.message) for w in caught if "pageable" in str(w.message)]
    return out


def _checked(out: dict[str, Any], ckpt: str) -> dict[str, Any]:
    model = out.pop("model", None)
    if model is not None:
        ref = reference(ckpt, None)
        out["bad"] = compare_model(model, ref)
        out["tied"] = tied(model) == tied(ref)
        out["staging"] = getattr(model.streamload_report, "staging", None)
    return out


def case_refused(
    rank: int,
    world: int,
    *,
    ckpt: str,
    readers: str,
    refuse: int,
    backend: str = "cuda",
    compute: str = "host",
    eager: bool = False,
) -> dict[str, Any]:
    """Page-locking is refused on rank ``refuse``: its load stages through pageable memory.

    ``backend="cuda"``: the real ``CudaBackend`` on ``FaultyCuda``, whose ``cudaHostRegister``
    fails with cudaErrorMemoryAllocation and leaves it pending (the next launch would raise it);
    ``"fake"``: the asynchronous fake device refusing from the second slot on (``compute`` and
    ``eager`` as in ``FakeBackend``). Returns the outcome, the parameters that differ from
    transformers', ``LoadReport.staging``, the warnings and whether a CUDA error is left pending.
    """
    cuda = FaultyCuda(register_error=2 if rank == refuse else 0)
    watch = DeviceAgreements(cuda.pending)
    with contextlib.ExitStack() as stack:
        stack.enter_context(watch.installed())
        if backend == "cuda":
            stack.enter_context(cuda.installed())
        else:
            staging.BACKENDS["cpu"] = RefusingBackend if rank == refuse else FakeBackend
            stack.callback(staging.BACKENDS.pop, "cpu")
            FakeBackend.EAGER, FakeBackend.COMPUTE = eager, compute
            stack.callback(setattr, FakeBackend, "COMPUTE", "host")
            stack.callback(setattr, FakeBackend, "EAGER", False)
        out = _outcome(lambda: _load(ckpt, rank, readers))
    out["pending"] = cuda.pending()
    out["on_device"], out["on_side"] = watch.on_device, watch.on_side
    return _checked(out, ckpt)


def case_device_fault(
    rank: int,
    world: int,
    *,
    ckpt: str,
    readers: str,
    fail: int,
    at: str = "mid",
    compute: str = "host",
    sticky_register: bool = False,
) -> dict[str, Any]:
    """The device of rank ``fail`` faults: every rank must raise an error that names it.

    ``sticky_register``: ``cudaHostRegister`` fails because the device faulted (sticky: no
    fallback can help), through ``CudaBackend`` on ``FaultyCuda``. Else one of the copies of
    the asynchronous fake device faults on the copy stream: the second one (``at="mid"``), or
    the last one (``"last"``: nothing waits for it before the stream's end), found by a first,
    clean load.
    """
    if sticky_register:
        cuda = FaultyCuda(register_error=700 if rank == fail else 0, sticky=True)
        watch = DeviceAgreements(cuda.pending)
        with watch.installed(), cuda.installed():
            out = _outcome(lambda: _load(ckpt, rank, readers))
    else:
        watch = DeviceAgreements(lambda: FaultingBackend.FAULTED["now"])
        staging.BACKENDS["cpu"] = FaultingBackend
        FakeBackend.COMPUTE = compute
        FaultingBackend.FAULTED["now"] = False
        try:
            with watch.installed():
                FakeBackend.LOG.clear()
                _load(ckpt, rank, readers)  # clean: how many copies this rank makes
                copies = sum(rec["copies"] for rec in FakeBackend.LOG)
                if rank == fail:
                    FaultingBackend.FAIL_AT = 1 if at == "mid" else copies - 1
                out = _outcome(lambda: _load(ckpt, rank, readers))
                out["copies"] = copies
        finally:
            FaultingBackend.FAIL_AT = None
            FakeBackend.COMPUTE = "host"
            del staging.BACKENDS["cpu"]
    out.pop("model", None)
    out["on_device"], out["on_side"] = watch.on_device, watch.on_side
    return out
