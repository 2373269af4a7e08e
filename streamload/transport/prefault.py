"""Prefault: fault in the pages of freshly allocated CPU shards on a helper thread.

A shard that ``to_empty`` just allocated has no pages yet: its first write takes a
fault and a page of zeroing per 4 KiB (measured here: filling 256 MiB of fresh memory
0.092 s, of populated memory 0.014 s). In the ``src`` pipeline the receivers spend
most of the load waiting for their next bucket, and the reader waits for the disk at
the start; ``madvise(MADV_POPULATE_WRITE)`` on a helper thread takes those faults
during the waits instead of inside the unpack and pack copies. It never changes a
byte: it faults pages in writable "as if written" without writing, so it is safe
while the pipeline writes into the same pages (Linux >= 5.14; elsewhere ``madvise``
answers ``EINVAL`` and nothing happens). ``load_checkpoint(prefault=False)`` turns it off
(``STREAMLOAD_PREFAULT=0`` where the keyword is not given).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..options import env_flag

MADV_POPULATE_WRITE = 23  # linux/mman.h
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
PAGE = 4096
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 with 4 KiB pages
_STEP = 64 << 20  # populate in steps, so a failing range stops early


def _libc_madvise() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise(ranges: Sequence[tuple[int, int]], advice: int) -> bool:
    """``madvise(advice)`` on each page-aligned [start, end) range; False where the host refuses
    (no ``madvise``, or ``EINVAL``: an old kernel, THP compiled out) and nothing is changed.

    Example:
        >>> advise(page_ranges([buffer]), MADV_HUGEPAGE)
    """
    madvise = _libc_madvise() if ranges else None
    if madvise is None:
        return False
    return all(madvise(a, b - a, advice) == 0 for a, b in ranges if b > a)


def page_ranges(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-aligned [start, end) address ranges of the tensors' storages, merged.

    Example:
        >>> page_ranges([torch.empty(10000, dtype=torch.uint8)])  # one or two pages' span
    """
    spans = []
    for t in tensors:
        if t.device.type != "cpu":
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0:
            continue
        a = st.data_ptr() // PAGE * PAGE
        spans.append((a, -(-(st.data_ptr() + st.nbytes()) // PAGE) * PAGE))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def prefault(tensors: Sequence[torch.Tensor], enabled: bool | None = None) -> threading.Thread | None:
    """Starts faulting in the tensors' pages on a daemon thread; returns it (join before
    the memory may be freed), or None when there is nothing to do or it is turned off.

    Only for anonymous memory the caller is about to write (fresh shards): on a private
    file mapping it would copy every page.

    Args:
        tensors: the fresh shards.
        enabled: the load's ``prefault`` keyword (None: not given, then
            ``STREAMLOAD_PREFAULT`` decides, else on).

    Example:
        >>> worker = prefault(local_shards)
        >>> ...  # the pipeline runs, writing into the shards
        >>> if worker is not None:
        ...     worker.join()
    """
    if env_flag("prefault", enabled) is False:
        return None
    ranges = page_ranges(tensors)
    madvise = _libc_madvise() if ranges else None
    if madvise is None:
        return None

    def run() -> None:
        for a, b in ranges:
            for s in range(a, b, _STEP):
                # ctypes releases the GIL around the call; a refusal (old kernel) ends the work.
                if madvise(s, min(_STEP, b - s), MADV_POPULATE_WRITE) != 0:
                    return

    worker = threading.Thread(target=run, name="streamload-prefault", daemon=True)
    worker.start()
    return worker


def populate_on_copy(engine: Any, enabled: bool | None = None) -> None:
    """Sets whether ``engine`` (a native copy engine, or one wrapping it as ``.engine``) faults
    in each piece's destination pages in one ``madvise(MADV_POPULATE_WRITE)`` right before
    copying it (``populate_pages`` in csrc/copy_engine.h; on unless ``prefault`` is off).

    The same faults a copy takes page by page, taken in one call
    (``python benchmarks/bench_first_touch.py`` measures the engine both ways). It never
    changes a byte and needs no helper thread: it holds wherever the engine copies, on
    ``src`` and ``owners`` readers alike (a cold read that lands in place writes without it).

    Example:
        >>> populate_on_copy(checkpoint.engine, options.prefault)
    """
    native = getattr(engine, "engine", engine)
    if hasattr(native, "populate"):
        native.populate = env_flag("prefault", enabled) is not False
