"""Fault cases for save_pretrained in gloo ranks (run by tests/test_save_faults.py).

An FSDP2 model is loaded once per rank process and kept; each case saves it with one
failure injected on one rank (the packer, os.pwrite, the plan, a KeyboardInterrupt
mid-stream), reports what every rank raised, then saves again without a fault: the ranks
must still be in step (every rank ran the same collectives) for that save to succeed."""

from __future__ import annotations

import errno
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import streamload
from streamload.errors import SaveError
from streamload.save import commit, driver, write

BUCKET = 4096
SHARD = "16KB"
_MODELS: dict[str, nn.Module] = {}


def model_for(ckpt: str) -> nn.Module:
    """The checkpoint's model, FSDP2-sharded over the world (per layer and the root), loaded."""
    if ckpt in _MODELS:
        return _MODELS[ckpt]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    streamload.load_checkpoint(model, ckpt, device_mesh=mesh, bucket_bytes=BUCKET, progress=False)
    _MODELS[ckpt] = model
    return model


def _nth(at: int, fail: Callable[[], BaseException], real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, except that its ``at``-th call raises ``fail()``."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise fail()
        return real(*args, **kwargs)

    return wrapped


@contextmanager
def injected(where: str, at: int) -> Iterator[None]:
    """One failure at the ``at``-th call of the step ``where`` (in this process only)."""
    if where in ("pack", "interrupt"):
        exc: Callable[[], BaseException] = (
            (lambda: RuntimeError("injected pack failure")) if where == "pack" else KeyboardInterrupt
        )
        real = write._Packer.add
        write._Packer.add = _nth(at, exc, real)  # type: ignore[method-assign]
        try:
            yield
        finally:
            write._Packer.add = real  # type: ignore[method-assign]
    elif where in ("pwrite", "slow_pwrite"):
        real_pwrite = os.pwrite

        def full() -> OSError:
            if where == "slow_pwrite":  # fails late: src's write thread, after the next step began
                time.sleep(2.0)
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        os.pwrite = _nth(at, full, real_pwrite)
        try:
            yield
        finally:
            os.pwrite = real_pwrite
    elif where == "open":
        real_open = commit.Output.open
        commit.Output.open = _nth(  # type: ignore[method-assign]
            at, lambda: OSError(errno.EMFILE, os.strerror(errno.EMFILE)), real_open
        )
        try:
            yield
        finally:
            commit.Output.open = real_open  # type: ignore[method-assign]
    elif where == "plan":
        real_plan = driver.plan_save
        driver.plan_save = _nth(at, lambda: RuntimeError("injected plan failure"), real_plan)
        try:
            yield
        finally:
            driver.plan_save = real_plan
    else:
        raise ValueError(where)


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
    except SaveError as exc:
        return {"raised": "SaveError", "rank": exc.rank, "text": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is an expected outcome
        return {"raised": type(exc).__name__, "text": str(exc)}
    return {"raised": None}


def case_fault(
    rank: int, world: int, *, ckpt: str, out: str, writers: str, where: str, fail_rank: int, at: int
) -> dict[str, Any]:
    """A save with one injected failure on ``fail_rank``, then a clean save to ``out + '-after'``."""
    model = model_for(ckpt)

    def save(target: str) -> Any:
        return driver.save_pretrained(
            model, target, writers=writers, max_shard_size=SHARD, bucket_bytes=BUCKET
        )

    if rank == fail_rank:
        with injected(where, at):
            got = _outcome(lambda: save(out))
    else:
        got = _outcome(lambda: save(out))
    rep = save(out + "-after")
    got["after"] = rep.writers
    return got


def case_save(
    rank: int, world: int, *, ckpt: str, out: str, writers: str, per_rank: bool = False
) -> dict[str, Any]:
    """A clean save; ``per_rank``: rank r saves to ``out/r/ckpt`` (each rank a directory of its own,
    as on machines that do not share a file system)."""
    model = model_for(ckpt)
    target = os.path.join(out, str(rank), "ckpt") if per_rank else out
    reports: list[Any] = []
    got = _outcome(
        lambda: reports.append(
            driver.save_pretrained(model, target, writers=writers, max_shard_size=SHARD, bucket_bytes=BUCKET)
        )
    )
    if reports:
        got.update(writers=reports[0].writers, bytes=reports[0].bytes_written)
    return got


def case_disagree(rank: int, world: int, *, ckpt: str, out: str, how: str) -> dict[str, Any]:
    """A save whose ranks cannot write one checkpoint: ``"dtype"`` - rank 1 casts, the others do
    not (other headers, other offsets); ``"subgroup"`` - each rank saves over a group of its
    own (a group smaller than the model's mesh: the other ranks' bytes would stay zeros)."""
    model = model_for(ckpt)
    if how == "dtype":
        got = _outcome(lambda: driver.save_pretrained(model, out, dtype=torch.float32 if rank == 1 else None))
    else:
        own = [dist.new_group([r]) for r in range(world)][rank]  # new_group is collective over the world
        got = _outcome(lambda: driver.save_pretrained(model, f"{out}-{rank}", process_group=own))
    rep = driver.save_pretrained(model, out + "-after")  # still in step
    got["after"] = rep.writers
    return got
