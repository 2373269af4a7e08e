"""A plain CPU model loaded under an NCCL-only group, faked on gloo ranks: the default group (and
a subgroup made before) is declared accelerator-only (``protocol.carries_cpu`` says no), and
every collective on such a group refuses, as NCCL does, with "No backend type associated with
device type cpu". Groups made with ``backend="gloo"`` carry CPU tensors as usual."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from cases_load import compare_model, reference, tied

import streamload
from streamload.transport import protocol

COLLECTIVES = (
    "all_gather",
    "all_to_all_single",
    "all_reduce",
    "broadcast",
    "scatter",
    "gather",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)
NCCL_REFUSAL = "No backend type associated with device type cpu"


def _group_of(name: str, args: tuple, kwargs: dict) -> Any:
    if "group" in kwargs:
        return kwargs["group"]
    # Positional: broadcast(tensor, src, group), all_gather(list, tensor, group), ...
    at = {"barrier": 0, "all_to_all_single": 4, "scatter": 3, "gather": 3}.get(name, 2)
    return args[at] if len(args) > at else None


@contextlib.contextmanager
def nccl_only(groups: list[Any]) -> Iterator[dict[str, int]]:
    """``groups`` (None: the default group) behave as NCCL-only groups for the block; returns
    the count of collectives each kind of group carried (``"nccl"``, ``"gloo"``)."""
    world = dist.group.WORLD
    marked = {id(world if g is None else g) for g in groups}
    real_carries = protocol.carries_cpu
    real = {name: getattr(dist, name) for name in COLLECTIVES}
    seen = {"nccl": 0, "gloo": 0}

    def accelerator_only(group: Any) -> bool:
        return id(world if group is None else group) in marked

    def wrap(name: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if accelerator_only(_group_of(name, args, kwargs)):
                seen["nccl"] += 1
                raise RuntimeError(NCCL_REFUSAL)
            seen["gloo"] += 1
            return real[name](*args, **kwargs)

        return wrapped

    protocol.carries_cpu = lambda group=None: not accelerator_only(group)  # type: ignore[assignment]
    for name in COLLECTIVES:
        setattr(dist, name, wrap(name))
    try:
        yield seen
    finally:
        protocol.carries_cpu = real_carries  # type: ignore[assignment]
        for name, fn in real.items():
            setattr(dist, name, fn)


def _process_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def case_cpu_model_under_nccl(rank: int, world: int, *, ckpt: str, readers: str) -> dict:
    """A plain CPU model (no mesh) loaded over the NCCL-only default group, twice (the gloo
    group of each load is destroyed with it); the model equals transformers' bit for bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    before = _process_groups()
    results = []
    with nccl_only([None]) as seen:
        for _ in range(2):
            model = AutoModelForCausalLM.from_config(config)  # on the CPU, random weights
            try:
                report = streamload.load_checkpoint(
                    model, ckpt, readers=readers, bucket_bytes=4096, progress=False
                )
            except Exception as exc:  # noqa: BLE001 - reported to the test
                results.append(f"{type(exc).__name__}: {exc}")
                continue
            bad = compare_model(model, reference(ckpt, next(model.parameters()).dtype))
            results.append("loaded" if not bad and tied(model) else f"differs: {bad[:3]} tied={tied(model)}")
            results.append(report.reader.split(":")[0])
    return {"results": results, "seen": dict(seen), "groups": _process_groups() - before}


def case_cpu_model_under_nccl_subgroup(rank: int, world: int, *, ckpt: str) -> dict:
    """The same over an NCCL-only subgroup of ranks [0, world-1): no gloo twin can be made
    over part of the world, so every rank of it refuses with a PlacementError, before any
    collective; the ranks outside take no part."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sub = dist.new_group(list(range(world - 1)))  # every rank makes it, as new_group requires
    if rank == world - 1:
        return {"outside": True}
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
    with nccl_only([None, sub]) as seen:
        try:
            streamload.load_checkpoint(model, ckpt, process_group=sub, progress=False, timeout=30)
            outcome = "loaded"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome, "seen": dict(seen), "dtype": str(next(model.parameters()).dtype)}


def case_cuda_wire_unchanged(rank: int, world: int) -> dict:
    """The route for a device wire is the group itself (the status flags get their own side group)."""
    with nccl_only([None]):
        route = protocol.open_wire_route(dist.group.WORLD, torch.device("cuda", 0))
    return {"same": route.group is dist.group.WORLD, "owned": route.owned}


def case_cpu_model_saved_under_nccl(rank: int, world: int, *, ckpt: str, out: str) -> dict:
    """The checkpoint's model, plain on the CPU, saved over the NCCL-only default group with each
    writer: everything (the src exchange too) rides a gloo twin; returns what was seen."""
    import warnings

    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(ckpt)
    before = _process_groups()
    results = []
    with nccl_only([None]) as seen:
        for writers in ("owners", "src"):
            try:
                rep = streamload.save_pretrained(
                    model, f"{out}-{writers}", writers=writers, max_shard_size="8KB"
                )
                results.append(rep.writers)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                results.append(f"{type(exc).__name__}: {exc}")
    return {"results": results, "seen": dict(seen), "groups": _process_groups() - before}
