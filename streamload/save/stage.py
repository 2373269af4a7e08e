"""Device shards on their way out: copied into page-locked host slots before the writers cast,
quantize and pack them on the host.

A save of CUDA parameters reads each piece of a local shard (a bucket-sized box, already cut
by the writer) with one device-to-host copy into one of two page-locked slots on a copy stream
of its own, so the copy of piece k+1 runs while piece k is cast into the write buffer (and
written). The bytes leave the device in the parameter's own dtype: the cast to the output
dtype, fp8 quantization included, happens on the host, where torch's CPU casts decide every
bit (the NaN rule of the load, docs/design.md), whatever the device would round.

The device side is ``transport.staging``'s backend (``BACKENDS``): ``CudaBackend`` on GPUs, a
test's fake on the CPU. A device that refuses to page-lock the slots gets pageable slots and
synchronous copies, with the warning the load gives.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from ..transport.staging import BACKENDS, PageLockRefused

T = TypeVar("T")
SLOTS = 2


def backend_for(device: torch.device) -> Any:
    """The staging backend factory for ``device``'s type, or None (the CPU: nothing to stage)."""
    return BACKENDS.get(device.type)


class DeviceReader:
    """Two host slots of ``slot_bytes`` and a device backend; ``stream`` hands out host copies.

    Args:
        device: the device the shards live on.
        slot_bytes: the largest piece, in its own dtype.

    Attributes:
        staging: "pinned" (both slots page-locked) or "pageable" (the device refused).
        copies: device-to-host copies made.
    """

    def __init__(self, device: torch.device, slot_bytes: int) -> None:
        self.device = device
        self.backend = BACKENDS[device.type](device)
        self.hosts: list[torch.Tensor] = []
        self.staging = "pinned"
        self.copies = 0
        try:
            for _ in range(SLOTS):
                try:
                    lock = self.staging == "pinned"
                    self.hosts.append(self.backend.host_buffer(slot_bytes, lock=lock))
                except PageLockRefused as exc:
                    warnings.warn(
                        f"streamload: {exc}: the save's staging slots are pageable memory, "
                        "read from the device synchronously (slower)",
                        stacklevel=3,
                    )
                    self.staging = "pageable"
                    self.hosts.append(self.backend.host_buffer(slot_bytes, lock=False))
        except BaseException:
            with contextlib.suppress(Exception):
                self.backend.release()
            raise

    def stream(self, items: Iterable[tuple[T, torch.Tensor]]) -> Iterator[tuple[T, torch.Tensor]]:
        """``(key, device part)`` in, ``(key, host copy)`` out, in order.

        The copy of the next part is issued before the current one is handed out; a slot is
        refilled only after the caller asked for the item after the one it held (it is done with
        it), and the host waits for a copy's event before handing its slot out.
        """
        pending: tuple[T, torch.Tensor, Any] | None = None
        k = 0
        for key, part in items:
            if part.device.type != self.device.type:  # a host-resident shard (CPU offload): as it is
                if pending is not None:
                    yield self._ready(pending)
                    pending = None
                yield key, part
                continue
            host = self._slot(k % SLOTS, part)
            k += 1
            # After whatever the compute stream did to the parameters (an optimizer step).
            event = self.backend.copy(host, part, self.backend.record_compute())
            self.copies += 1
            if self.staging == "pageable":
                self.backend.wait(event)
            if pending is not None:
                yield self._ready(pending)
            pending = (key, host, event)
        if pending is not None:
            yield self._ready(pending)

    def _slot(self, s: int, part: torch.Tensor) -> torch.Tensor:
        nbytes = part.numel() * part.element_size()
        slot = self.hosts[s]
        if nbytes > slot.numel():
            raise AssertionError(
                f"a piece of {nbytes} bytes does not fit the {slot.numel()}-byte staging slot"
            )
        return slot[:nbytes].view(part.dtype).view(part.shape)

    def _ready(self, pending: tuple[T, torch.Tensor, Any]) -> tuple[T, torch.Tensor]:
        key, host, event = pending
        self.backend.wait(event)
        return key, host

    def close(self) -> None:
        """Waits for every copy, then releases the slots (a device fault raises here)."""
        try:
            self.backend.synchronize()
        finally:
            self.hosts = []
            self.backend.release()


@contextlib.contextmanager
def device_reader(parts: list[torch.Tensor]) -> Iterator[DeviceReader | None]:
    """A DeviceReader sized for ``parts`` when they live on a device that stages, else None.

    Example:
        >>> with device_reader(parts) as reader:
        ...     for key, host in reader.stream(zip(keys, parts)):
        ...         pack(key, host)
    """
    on = [p for p in parts if p.numel() and backend_for(p.device) is not None]
    if not on:
        yield None
        return
    reader = DeviceReader(on[0].device, max(p.numel() * p.element_size() for p in on))
    ok = False
    try:
        yield reader
        ok = True
    finally:
        if ok:
            reader.close()
        else:
            with contextlib.suppress(Exception):  # the error already raised is what the caller hears
                reader.close()
