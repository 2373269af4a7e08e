"""HubSource cases run inside the rank group (see rank_group.py): each is called on all ranks;
ranks outside the case's world size return None at once."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from cases_load import full, mesh_for, subgroup
from cases_save import _Allocations, _one_step
from safetensors.torch import load_file

import streamload
from streamload.io.copy_ops import bit_view as bits
from streamload.sync.source import HubSource

_COLLECTIVES = (
    "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_to_all_single",
    "gather", "scatter", "reduce_scatter_tensor", "send", "recv", "barrier",
)  # fmt: skip


@contextlib.contextmanager
def counted() -> Iterator[dict[str, int]]:
    """Counts torch.distributed collectives called inside the block, by name."""
    counts: dict[str, int] = {}
    saved = {n: getattr(dist, n) for n in _COLLECTIVES}

    def wrap(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)

        return call

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _reference(
    ckpt: str, fulls: dict[str, torch.Tensor], dtype: torch.dtype | None, group: Any
) -> dict[str, torch.Tensor]:
    """transformers' own save_pretrained of the gathered model (made by rank 0: transformers
    saves on one rank of a distributed run), read back on every rank."""

    where = [tempfile.mkdtemp(prefix="streamload_syncref_")]
    if dist.get_rank() == 0:
        _save_reference(ckpt, fulls, dtype, where[0])
    dist.broadcast_object_list(where, src=0, group=group)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(where[0])):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(where[0], f)))
    return state


def _save_reference(ckpt: str, fulls: dict[str, torch.Tensor], dtype: torch.dtype | None, out: str) -> None:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(fulls[n])
    if dtype is not None:
        ref = ref.to(dtype)
    ref.save_pretrained(out)


def case_source(
    rank: int,
    world: int,
    *,
    ckpt: str,
    ws: int,
    dtype: torch.dtype | None = None,
    receivers: str | int = "all",
    passes: int = 2,
    keep_buffer: bool = True,
) -> dict[str, Any] | None:
    """load -> one optimizer step -> HubSource passes -> every yielded tensor equals transformers'
    save of the gathered model; collectives, group bytes and allocations recorded."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    group = subgroup(ws)
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, dtype=torch.float32, progress=False)
    _one_step(model)
    src = HubSource(model, dtype=dtype, receivers=receivers, process_group=group, keep_buffer=keep_buffer)
    allocs = _Allocations()
    got: dict[str, torch.Tensor | None] = {}
    order: list[str] = []
    per_group: list[int] = []
    with counted() as counts, allocs:
        for _ in range(passes):
            got.clear()
            order.clear()
            for names, tensors in src.iter_groups():
                per_group.append(sum(counts.values()))
                for n, t in zip(names, tensors, strict=True):
                    order.append(n)
                    got[n] = None if t is None else t.clone()
        kept = src.kept_bytes  # each group cloned and let go: its buffer kept for the next pass
        flat = [(n, t) for n, t in src]  # the plain iterator: the same pairs (all held: none kept)
    fulls = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    result: dict[str, Any] = {
        "collectives": dict(counts),
        "groups": len(src.groups()),
        "per_group": per_group,
        "stats": src.stats,
        "largest_group": src.largest_group_bytes,
        "allocated": allocs.largest,
        "model_bytes": sum(t.nbytes for t in fulls.values()),
        "largest_param": max(t.nbytes for t in fulls.values()),
        "received": sum(t is not None for t in got.values()),
        # groups whose reused buffer is zeroed only outside this rank's pieces (the rest written over)
        "partly_zeroed": sum(g is not None and len(g) > 0 for g in src._gaps),
        "kept": kept,
        "kept_after_flat": src.kept_bytes,
    }
    assert order == [m.name for m in src.metadata()], "iteration order is not metadata() order"
    assert [n for n, _ in flat] == order
    ref = _reference(ckpt, fulls, dtype, group)
    if src.receives:
        assert sorted(got) == sorted(ref), sorted(set(got) ^ set(ref))
        bad = [
            n
            for n, t in got.items()
            if t is None
            or t.dtype != ref[n].dtype
            or t.shape != ref[n].shape
            or not torch.equal(bits(t), bits(ref[n]))
        ]
        assert not bad, f"tensors differ from transformers' save: {bad}"
        for m in src.metadata():
            assert (
                got[m.name] is not None
                and got[m.name].dtype == m.dtype
                and tuple(got[m.name].shape) == m.shape
            )
    else:
        assert all(t is None for t in got.values())
    del group
    return result


def case_groups_held(rank: int, world: int, *, ckpt: str, ws: int) -> dict[str, list[int]] | None:
    """A plain pass consumed as vLLM's ``load_weights`` loop does (its loop variable holds the last
    tensor it took while it asks for the next): for each group materialised, how many earlier
    group buffers were still alive then."""
    import weakref

    from streamload.sync.source import HubSource

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    group = subgroup(ws)
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, dtype=torch.float32, progress=False)
    src = HubSource(model, process_group=group)
    import numpy as np

    from streamload.sync import buffers as buffers_mod

    real, real_zeros, keep = HubSource._materialise, np.zeros, buffers_mod.BufferPool.KEEP
    refs: list[Any] = []  # each group buffer's memory: a numpy array, alive while any view is
    alive: list[int] = []

    def zeros(n: Any, dtype: Any = None, **kw: Any) -> Any:
        arr = real_zeros(n, dtype=dtype, **kw)
        if dtype is np.uint8 and isinstance(n, int):
            refs.append(weakref.ref(arr))
        return arr

    def materialise(self: HubSource, g: Any) -> Any:
        # gloo's worker thread lets go of a finished collective's tensors shortly after it ends:
        # a second's grace, so only a hold of streamload's or the consumer's is counted.
        deadline = time.monotonic() + 1.0
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            time.sleep(0.005)
        alive.append(sum(r() is not None for r in refs))
        return real(self, g)

    HubSource._materialise = materialise  # type: ignore[method-assign]
    # Every group in a buffer of its own (no reuse), whose life the weak references watch.
    buffers_mod.BufferPool.KEEP = 0
    buffers_mod.np.zeros = zeros  # type: ignore[assignment]
    try:
        last = None
        for _name, tensor in src:
            last = tensor  # noqa: F841 - held, as a consumer's loop variable is
    finally:
        HubSource._materialise = real  # type: ignore[method-assign]
        buffers_mod.np.zeros = real_zeros  # type: ignore[assignment]
        buffers_mod.BufferPool.KEEP = keep
    assert len(refs) == len(alive) == len(src.groups()), (len(refs), alive)
    from streamload.sync.buffers import pinned_bytes

    # Only a previous group whose last tensor is over half of it is still held (by the consumer's
    # loop variable; a smaller one is moved off the buffer): the untied embeddings' group.
    groups = src.planned_groups
    held = [0] + [int(pinned_bytes(g) == g.nbytes) for g in groups[:-1]]
    del group
    return {"alive": alive, "expected": held}
