"""Page residency of a tensor's memory, for tests of what faults pages in (prefault, populate)."""

from __future__ import annotations

import ctypes

import torch

from streamload.transport.prefault import PAGE, page_ranges


def resident(t: torch.Tensor) -> float:
    """Fraction of the tensor's pages present in memory (mincore on its storage)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    (a, b), *_ = page_ranges([t])
    vec = ctypes.create_string_buffer((b - a) // PAGE)
    assert libc.mincore(a, b - a, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec.raw) / len(vec.raw)
