"""The multi-rank paths in a group of one rank (``STREAMLOAD_FORCE_MULTI_RANK``): loads in every
reader mode and saves with both writers, each step's collectives counted, every tensor compared
bit-exactly. One function serves both halves: ``run_world1`` on one NCCL rank (tests/test_gpu.py,
the device check) and ``case_world1`` on one gloo rank (tests/test_world1_paths.py, CI)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import streamload
from streamload.io.copy_ops import bit_view as bits
from streamload.options import FORCE_MULTI_RANK, force_multi_rank

# What streamload's multi-rank paths call: the transport and the save's src writer
# (all_to_all_single), the object gathers and the status flags, the metadata broadcast, the side group.
COUNTED = ("all_to_all_single", "all_gather", "all_reduce", "broadcast", "new_group")


@contextlib.contextmanager
def forced(on: bool = True) -> Iterator[None]:
    """``STREAMLOAD_FORCE_MULTI_RANK`` set to ``on`` (and read again) for the block."""
    old = os.environ.get(FORCE_MULTI_RANK)
    os.environ[FORCE_MULTI_RANK] = "1" if on else "0"
    force_multi_rank.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ[FORCE_MULTI_RANK]
        else:
            os.environ[FORCE_MULTI_RANK] = old
        force_multi_rank.cache_clear()


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Counts calls of ``COUNTED`` (``new_group`` by backend: ``new_group:gloo``) for the block."""
    calls: Counter = Counter()
    real = {name: getattr(dist, name) for name in COUNTED}

    def wrap(name: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls[f"{name}:{kwargs.get('backend')}" if name == "new_group" else name] += 1
            return real[name](*args, **kwargs)

        return wrapped

    for name in COUNTED:
        setattr(dist, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return bits(t.detach().cpu())


def _differ(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> list[str]:
    """Names of ``model``'s parameters whose bits differ from ``want``'s (safetensors' read)."""
    got = dict(model.named_parameters())
    return [k for k, p in got.items() if k in want and not torch.equal(_host(p), bits(want[k]))]


def checkpoint_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``ckpt``'s files, read by safetensors."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_world1(ckpt: str, out: str, mesh: Any, readers: tuple[str, ...] = ("src", "owners", "node")) -> dict:
    """Loads ``ckpt`` once per reader mode and saves the last model with each writer, counting the
    collectives of each step; raises on any difference from safetensors' read of ``ckpt``.

    ``ckpt`` is transformers' ``save_pretrained`` output (tools.synthetic), so a save with its
    ``max_shard_size`` must write the same tensors and, byte for byte, the same weight files.

    Returns:
        ``{"load:<readers>": counts, "save:<writers>": counts, "reader": [report.reader ...]}``.
    """
    want = checkpoint_tensors(ckpt)
    result: dict[str, Any] = {"reader": []}
    model = None
    for mode in readers:
        with counting() as calls:
            model = streamload.from_pretrained(
                ckpt, device_mesh=mesh, progress=False, readers=mode, bucket_bytes=8192
            )
        result[f"load:{mode}"] = dict(calls)
        result["reader"].append(model.streamload_report.reader)
        bad = _differ(model, want)
        assert not bad, f"readers={mode}: differs from safetensors: {bad[:5]}"
        assert model.lm_head.weight is model.get_input_embeddings().weight, "untied"
    assert model is not None
    for writers in ("owners", "src"):
        target = os.path.join(out, writers)
        with counting() as calls:
            report = streamload.save_pretrained(
                model, target, writers=writers, max_shard_size="30KB", bucket_bytes=4096
            )
        result[f"save:{writers}"] = dict(calls)
        assert report.writers == writers, report.writers
        names = sorted(p.name for p in Path(ckpt).iterdir() if "safetensors" in p.name)
        assert names == sorted(p.name for p in Path(target).iterdir() if "safetensors" in p.name), names
        for name in names:
            if name.endswith(".safetensors"):
                got, ref = load_file(os.path.join(target, name)), load_file(os.path.join(ckpt, name))
                bad = [k for k in ref if not torch.equal(bits(got[k]), bits(ref[k]))]
                assert sorted(got) == sorted(ref) and not bad, f"writers={writers}: {name} differs: {bad[:5]}"
            same = Path(target, name).read_bytes() == Path(ckpt, name).read_bytes()
            assert same, f"writers={writers}: {name} differs from transformers' bytes"
    return result


def case_world1(rank: int, world: int, *, ckpt: str, force: bool) -> dict:
    """``run_world1`` on this one gloo rank, with the switch ``force``."""
    from torch.distributed.device_mesh import init_device_mesh

    assert world == 1
    mesh = init_device_mesh("cpu", (1,))
    with forced(force), tempfile.TemporaryDirectory(prefix="streamload_world1_") as out:
        return run_world1(ckpt, out, mesh)
