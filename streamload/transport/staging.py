"""Staging for the GPU pipelines: host slots -> device buffers, with an event per slot.

A ``Stager`` is the device-agnostic part (which slot bucket k uses, what must have
completed before a slot is packed again or a device buffer is overwritten); a
backend supplies the memory, the copy stream and the events. ``CudaBackend`` is
the real one; tests plug a fake backend into ``BACKENDS`` to watch slot reuse on
the CPU.

Memory: host slots are page-locked with ``cudaHostRegister`` on a plain buffer
and unregistered in ``close``, rather than taken from ``pin_memory=True``:
torch's caching host allocator keeps every pinned block for the life of the
process, so a staging ring allocated there would stay pinned after the load.
Device buffers are freed back to torch's caching allocator (the caller's next
allocation reuses them); streamload never calls ``torch.cuda.empty_cache()``,
which would drop the whole process's cache.

Page-locking refused (a memlock limit, a sandboxed GPU runtime, some VMs, WSL): the
slots from the refused one on are plain pageable memory, and their copies are
synchronous (the host waits for each); ``Stager.staging`` says "pageable" and a
warning says why. A failed ``cudaHostRegister`` also leaves the CUDA runtime's last
error set, which the rank's next kernel launch would raise (a spurious error on that
rank alone, before a collective its peers then wait in): ``clear_last_error`` reads
it back first, and tells a refusal from a device that faulted (a sticky error).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

PAGE = 4096

# Bytes streamload holds page-locked right now, every stager together (0 between loads).
_REGISTERED = {"bytes": 0}


def registered_bytes() -> int:
    """Host bytes streamload's stagers hold page-locked now; 0 once every load returned.

    Example:
        >>> assert registered_bytes() == 0
    """
    return _REGISTERED["bytes"]


class PageLockRefused(RuntimeError):
    """The device refused to page-lock a host slot; the Stager falls back to pageable memory.

    Args:
        code: the runtime's error code.
        nbytes: the slot's size.
    """

    def __init__(self, code: int, nbytes: int) -> None:
        super().__init__(f"cudaHostRegister of {nbytes} staging bytes was refused: {_error_text(code)}")
        self.code = code


def _error_text(code: int) -> str:
    """``cudaError <code> (<the runtime's text>)``; the code alone where the runtime cannot say."""
    try:
        rt = torch.cuda.cudart()
        return f"cudaError {code} ({rt.cudaGetErrorString(rt.cudaError(code))})"
    except Exception:  # noqa: BLE001 - the code is the message then
        return f"cudaError {code}"


def _launch(device: torch.device) -> None:
    """Launches one tiny kernel (a fill) on ``device``. torch checks every launch with
    ``cudaGetLastError``, which returns the runtime's last error and resets it."""
    torch.ones(1, dtype=torch.uint8, device=device)


def clear_last_error(device: torch.device) -> None:
    """Reads back (and so resets) an error a runtime call left set on this thread, e.g. a failed
    ``cudaHostRegister``: torch's binding returns the code but leaves the error set, and the next
    kernel launch (any later torch op on the device, a collective's) would raise it.

    torch 2.13's ``cudart()`` binds no ``cudaGetLastError``; a launch's own check is the way to
    it: the first launch raises the stale error (reading it resets it), a second one fails only
    when the error is sticky, i.e. the device itself faulted; that error is raised.

    Raises:
        RuntimeError: the device faulted (a sticky CUDA error).

    Example:
        >>> err = int(torch.cuda.cudart().cudaHostRegister(ptr, n, 0))
        >>> if err:
        ...     clear_last_error(torch.device("cuda", 0))
    """
    try:
        _launch(device)
        return
    except RuntimeError:
        pass  # the stale error, now read and reset
    _launch(device)


class Event(Protocol):
    """A point on a stream; the host can wait for it."""

    def synchronize(self) -> None: ...


class Backend(Protocol):
    """What a Stager needs from a device.

    Example:
        >>> stager = Stager(2, 64 << 20, CudaBackend(torch.device("cuda", 0)))
    """

    def host_buffer(self, nbytes: int, lock: bool = True) -> torch.Tensor:
        """``nbytes`` of host memory, page-locked when ``lock`` (``PageLockRefused`` if refused)."""
        ...

    def device_buffer(self, nbytes: int) -> torch.Tensor: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event) -> Event: ...

    def compute_waits(self, event: Event) -> None: ...

    def on_compute(self, fn: Callable[[], object]) -> None:
        """Runs ``fn``'s device work on the compute stream (on CUDA: calls it)."""
        ...

    def record_compute(self) -> Event: ...

    def wait(self, event: Event) -> None: ...

    def synchronize(self) -> None: ...

    def release(self) -> None: ...


class Stager:
    """``slots`` host slots and as many device buffers, used round-robin by bucket index.

    The pipeline calls, for bucket k: ``host(k)`` (the slot to pack into), ``push(k, wire)``
    (starts the copy; returns the device bytes the compute stream may use), and once the
    consumer of those device bytes is enqueued on the compute stream, ``consumed(k)``.

    - ``host(k)`` waits (host side) for the copy that last read the slot, and only for that:
      with >= 2 slots, bucket k+1 is packed while bucket k is still being copied.
    - ``push(k)`` starts the copy after the event recorded by ``consumed(k - slots)``, so a
      device buffer is overwritten only after its previous bucket was unpacked or sent.
    - A slot the device refused to page-lock (``PageLockRefused``) is pageable memory, as is
      every later one; its copies are synchronous (``push`` returns once the copy ran), and
      ``staging`` says "pageable" (a warning says why).

    Args:
        slots: number of host slots and device buffers (>= 1).
        nbytes: bytes per slot.
        backend: the device side (``CudaBackend``, or a test's fake).
    """

    def __init__(self, slots: int, nbytes: int, backend: Backend) -> None:
        if slots < 1:
            raise ValueError("a stager needs at least one slot")
        self.backend = backend
        self.slot_bytes = nbytes
        self.hosts: list[torch.Tensor] = []
        self.locked: list[bool] = []  # page-locked (else pageable: copied synchronously)
        refused: PageLockRefused | None = None
        try:
            for _ in range(slots):
                if refused is None:
                    try:
                        self.hosts.append(backend.host_buffer(nbytes))
                        self.locked.append(True)
                        continue
                    except PageLockRefused as exc:
                        refused = exc
                self.hosts.append(backend.host_buffer(nbytes, lock=False))
                self.locked.append(False)
            self.devices = [backend.device_buffer(nbytes) for _ in range(slots)]
        except BaseException:
            # The slots registered before the failure go; the failure is what the caller hears.
            with contextlib.suppress(Exception):
                backend.release()
            raise
        if refused is not None:
            warnings.warn(
                f"streamload: {refused} (a memlock limit or a sandboxed GPU runtime?): "
                f"{self.locked.count(False)} of {slots} staging slots are pageable memory, "
                "copied to the device synchronously (slower; LoadReport.staging is 'pageable')",
                stacklevel=3,
            )
        # The buffers were just allocated on the compute stream: a copy into one
        # must follow whatever that stream did with the memory before.
        start = backend.record_compute()
        self.freed: list[Event] = [start] * slots
        self.copied: list[Event | None] = [None] * slots
        self.pending = [False] * slots  # device buffer holds a bucket not yet consumed
        self.peak_bytes = slots * nbytes

    @property
    def slots(self) -> int:
        return len(self.hosts)

    @property
    def staging(self) -> str:
        """How the host slots are held: "pinned" (all page-locked) or "pageable" (refused)."""
        return "pinned" if all(self.locked) else "pageable"

    def host(self, k: int) -> torch.Tensor:
        """Bucket k's host slot, once the copy that last read it has completed."""
        s = k % self.slots
        event = self.copied[s]
        if event is not None:
            self.backend.wait(event)
            self.copied[s] = None
        return self.hosts[s]

    def push(self, k: int, wire: torch.Tensor) -> torch.Tensor:
        """Starts copying bucket k's packed bytes; returns them on the device.

        The compute stream is made to wait for the copy, so work enqueued there
        afterwards (an unpack, a collective) sees the bytes.
        """
        s = k % self.slots
        if self.pending[s]:
            raise AssertionError(f"device buffer {s} reused before bucket {k - self.slots} was consumed")
        if wire.untyped_storage().data_ptr() != self.hosts[s].untyped_storage().data_ptr():
            raise AssertionError(f"bucket {k} was not packed into its host slot {s}")
        dev = self.devices[s][: wire.numel()]
        event = self.backend.copy(dev, wire, self.freed[s])
        self.copied[s] = event
        if not self.locked[s]:
            self.backend.wait(event)  # pageable memory: the copy is done before the slot is reused
            self.copied[s] = None
        self.backend.compute_waits(event)
        self.pending[s] = True
        return dev

    def device(self, k: int) -> torch.Tensor:
        """Bucket k's device buffer as it is (a failed pack still takes part in its collective)."""
        self.pending[k % self.slots] = True
        return self.devices[k % self.slots]

    def on_compute(self, fn: Callable[[], object]) -> None:
        """Runs ``fn``, the consumer of a bucket's device bytes, on the compute stream: on CUDA
        its kernels queue there by themselves; a test's fake device runs it in stream order."""
        self.backend.on_compute(fn)

    def settle(self) -> None:
        """Waits for every copy and the compute stream: a device fault in queued work raises here."""
        self.backend.synchronize()

    def consumed(self, k: int) -> None:
        """Marks that the consumer of bucket k's device bytes is enqueued on the compute stream."""
        s = k % self.slots
        self.freed[s] = self.backend.record_compute()
        self.pending[s] = False

    def close(self) -> None:
        """Waits for every copy and the compute stream, then releases exactly what was allocated."""
        try:
            for event in self.copied:
                if event is not None:
                    self.backend.wait(event)
            self.backend.synchronize()
        finally:
            self.copied = [None] * self.slots
            self.hosts, self.devices = [], []
            self.backend.release()


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """``device`` is the current CUDA device inside the block.

    Runtime calls that take no device (``cudaHostRegister``/``Unregister``, event
    creation, the current stream) act on the current device; a rank whose load
    device is not the current one would otherwise create a context on GPU 0.
    """
    with torch.cuda.device(device):
        yield


class CudaBackend:
    """Registered host memory, a dedicated copy stream and CUDA events on ``device``.

    Every call runs with ``device`` current (see ``_on``), whatever the caller's current device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with _on(device):
            self.stream = torch.cuda.Stream(device)
        self._registered: list[tuple[int, torch.Tensor]] = []
        self._locked: set[int] = set()  # storages of the registered slots (copied asynchronously)

    def host_buffer(self, nbytes: int, lock: bool = True) -> torch.Tensor:
        """A page-aligned plain buffer, page-locked until ``release`` when ``lock`` (see the
        module docstring).

        Raises:
            PageLockRefused: the runtime refused to page-lock it (its error is cleared).
            RuntimeError: ``cudaHostRegister`` failed because the device faulted.
        """
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        buf = raw[start : start + nbytes]
        if nbytes and lock:
            with _on(self.device):
                err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
                if err != 0:
                    try:
                        clear_last_error(self.device)
                    except RuntimeError as exc:
                        raise RuntimeError(
                            f"cudaHostRegister of {nbytes} staging bytes failed with "
                            f"{_error_text(err)} on a device that faulted: {exc}"
                        ) from exc
                    raise PageLockRefused(err, nbytes)
            self._registered.append((buf.data_ptr(), raw))
            self._locked.add(raw.untyped_storage().data_ptr())
            _REGISTERED["bytes"] += nbytes
        return buf

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event) -> Event:
        with _on(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(after)  # type: ignore[arg-type]
            # Between pageable memory and the device a copy is synchronous (the host waits for it,
            # and for ``after``); a save's copies go the other way, into a registered slot.
            locked = {src.untyped_storage().data_ptr(), dst.untyped_storage().data_ptr()} & self._locked
            dst.copy_(src, non_blocking=bool(locked))
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def compute_waits(self, event: Event) -> None:
        with _on(self.device):
            torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def on_compute(self, fn: Callable[[], object]) -> None:
        with _on(self.device):
            fn()  # its kernels queue on the current stream, which ``compute_waits`` ordered

    def record_compute(self) -> Event:
        with _on(self.device):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Event) -> None:
        """The host waits for ``event``."""
        with _on(self.device):
            event.synchronize()

    def synchronize(self) -> None:
        with _on(self.device):
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def release(self) -> None:
        registered, self._registered = self._registered, []
        self._locked.clear()
        with _on(self.device):
            errors = [int(torch.cuda.cudart().cudaHostUnregister(ptr)) for ptr, _ in registered]
        _REGISTERED["bytes"] -= sum(raw.numel() - PAGE for _, raw in registered)
        del registered  # the plain buffers go back to the OS with their tensors
        if any(errors):
            raise RuntimeError(f"cudaHostUnregister of the staging slots failed: cudaErrors {errors}")


# Device type -> backend factory. Only CUDA stages; on the CPU the pipelines read
# straight into the shards. Tests register a fake backend for "cpu".
BACKENDS: dict[str, Callable[[torch.device], Any]] = {"cuda": CudaBackend}


def open_stager(device: torch.device, slots: int, nbytes: int) -> Stager | None:
    """A Stager for ``device``, or None where its pipelines do not stage (the CPU).

    Example:
        >>> stager = open_stager(torch.device("cuda", 0), 2, 256 << 20)
    """
    factory = BACKENDS.get(device.type)
    if factory is None:
        return None
    return Stager(slots, nbytes, factory(device))


def settle(device: torch.device, stager: Stager | None = None) -> None:
    """Waits once, at the end of a load, for the work it enqueued on ``device``'s compute
    stream, and for ``stager``'s copies: a device fault in queued work raises here, before
    the load's last agreement (not later, in ``close``, where it could only be a warning)."""
    if stager is not None:
        stager.settle()
    elif device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
