"""Cases for tests/test_arrival.py: ranks that never call, call with different options, are
interrupted or killed inside a call. Each returns what this rank raised and how long it took."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import streamload
from streamload.transport import arrival


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _row(exc: BaseException | None, t0: float, **extra: Any) -> dict:
    return {
        "raised": type(exc).__name__ if exc is not None else None,
        "message": str(exc) if exc is not None else "",
        "ranks": list(getattr(exc, "ranks", []) or []),
        "step": getattr(exc, "step", None),
        "seconds": time.perf_counter() - t0,
        **extra,
    }


def _call(entry: str, ckpt: str, mesh: Any, timeout: float, out_dir: str) -> None:
    """One entry point, as a user's code calls it, on a model made here."""
    if entry == "from_pretrained":
        streamload.from_pretrained(ckpt, device_mesh=mesh, progress=False, timeout=timeout)
        return
    model = _MODEL["model"]
    if entry == "load_checkpoint":
        streamload.load_checkpoint(model, ckpt, device_mesh=mesh, progress=False, timeout=timeout)
    elif entry == "fsdp2_load_full_state_dict":
        full = streamload.Checkpoint.lazy(ckpt) if dist.get_rank() == 0 else {}
        streamload.fsdp2_load_full_state_dict(model, full, mesh, timeout=timeout)
    elif entry == "save_pretrained":
        streamload.save_pretrained(model, out_dir, device_mesh=mesh, timeout=timeout)
    else:
        raise ValueError(entry)


_MODEL: dict[str, Any] = {}


def case_prepare(rank: int, world: int, *, ckpt: str) -> None:
    """A sharded model per process, built once, for the entries that take one."""
    _MODEL["model"] = streamload.from_pretrained(ckpt, device_mesh=_mesh(world), progress=False)


def case_one_rank_never_calls(
    rank: int, world: int, *, ckpt: str, entry: str, absent: int, deadline: float, out_dir: str
) -> dict:
    """Rank ``absent`` raises in "its own code" before the call; the others call ``entry``.
    Then the absent rank makes the call it skipped (it meets the abandoned meeting and raises
    at once), and every rank loads once more together: the group is usable again."""
    mesh = _mesh(world)
    timeout = deadline
    t0 = time.perf_counter()
    exc: BaseException | None = None
    if rank == absent:
        try:
            raise RuntimeError("the framework's own code failed on this rank")
        except RuntimeError:
            pass
        time.sleep(timeout + 1.0)  # the peers gave up meanwhile
        late_t0 = time.perf_counter()
        try:
            _call(entry, ckpt, mesh, timeout, out_dir)
        except BaseException as e:  # noqa: BLE001 - reported
            exc = e
        row = _row(exc, late_t0)
    else:
        try:
            _call(entry, ckpt, mesh, timeout, out_dir)
        except BaseException as e:  # noqa: BLE001 - reported
            exc = e
        row = _row(exc, t0)
    # Back in step: one more load on every rank succeeds.
    streamload.load_checkpoint(_MODEL["model"], ckpt, device_mesh=mesh, progress=False, timeout=timeout)
    row["left_files"] = sorted(os.listdir(os.path.dirname(out_dir)))
    return row


def case_options_differ(rank: int, world: int, *, ckpt: str, option: str) -> dict:
    """Ranks pass different values of an option that must agree (or call different entries)."""
    mesh = _mesh(world)
    model = _MODEL["model"]
    t0 = time.perf_counter()
    exc: BaseException | None = None
    try:
        if option == "readers":
            readers = "src" if rank == 0 else "owners"
            streamload.load_checkpoint(model, ckpt, device_mesh=mesh, progress=False, readers=readers)
        elif option == "entry":
            if rank == 0:
                streamload.load_checkpoint(model, ckpt, device_mesh=mesh, progress=False)
            else:
                with tempfile.TemporaryDirectory() as d:
                    streamload.save_pretrained(model, os.path.join(d, "out"), device_mesh=mesh)
        elif option == "max_shard_size":
            with tempfile.TemporaryDirectory() as d:
                size = "5GB" if rank == 0 else "1MB"
                streamload.save_pretrained(model, os.path.join(d, "out"), device_mesh=mesh, max_shard_size=size)
        else:
            raise ValueError(option)
    except BaseException as e:  # noqa: BLE001 - reported
        exc = e
    return _row(exc, t0)


def case_submesh_then_world_group(rank: int, world: int, *, ckpt: str, out_dir: str) -> dict:
    """A (pp, dp, tp) mesh; pipeline stage 0 alone loads and saves through ``mesh["dp", "tp"]``;
    then every rank makes a world-wide group and uses it. With ``_flatten()`` (``new_group`` by
    stage 0's ranks only) torch's group counter differs between the stages and this hangs."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    sub = mesh["dp", "tp"]
    stage = mesh.get_coordinate()[0]
    if stage == 0:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
        streamload.load_checkpoint(model, ckpt, device_mesh=sub, progress=False)
        streamload.save_pretrained(model, out_dir, device_mesh=sub)
    g = dist.new_group(list(range(world)))
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    dist.destroy_process_group(g)
    return {"sum": float(t.item()), "stage": stage}


def case_interrupt_between_halves(rank: int, world: int, *, ckpt: str, victim: int) -> dict:
    """A Ctrl-C lands on ``victim`` between the two collectives of an agreement's object
    gather (the sizes, then the data). Without the deferral gloo aborts the process or the
    peers wait for the second half."""
    from torch.distributed import distributed_c10d as c10d

    mesh = _mesh(world)
    real = c10d.all_gather
    calls = {"n": 0}

    def all_gather(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: between the halves
        return out

    if rank == victim:
        c10d.all_gather = all_gather  # what torch's own all_gather_object calls
        dist.all_gather = all_gather  # what streamload's object gather calls
    t0 = time.perf_counter()
    exc: BaseException | None = None
    try:
        streamload.load_checkpoint(_MODEL["model"], ckpt, device_mesh=mesh, progress=False)
    except BaseException as e:  # noqa: BLE001 - reported (KeyboardInterrupt included)
        exc = e
    finally:
        c10d.all_gather = dist.all_gather = real
    row = _row(exc, t0, gathers=calls["n"])
    # The group still works: every rank loads again.
    streamload.load_checkpoint(_MODEL["model"], ckpt, device_mesh=mesh, progress=False)
    return row


def case_killed_mid_call(rank: int, world: int, *, ckpt: str, entry: str, readers: str, out_dir: str) -> dict:
    """Rank ``world - 1`` is SIGKILLed in the middle of the stream (load) or of the writes (save)."""
    import streamload.save.driver as save_driver
    import streamload.transport.stream as stream

    mesh = _mesh(world)
    model = _MODEL["model"]
    if rank == world - 1:
        from streamload.transport.pack import Packer

        real_unpack, real_pack = stream.unpack, Packer.pack
        calls = {"n": 0}

        def dies_at(real: Any, nth: int) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                calls["n"] += 1
                if calls["n"] == nth:  # the stream runs (its buffers agreed, buckets moving)
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)

            return call

        def die(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        stream.unpack = dies_at(real_unpack, 2)  # src: a receiver unpacks each bucket
        Packer.pack = dies_at(real_pack, 1)  # type: ignore[method-assign]  # owners: each rank packs its own
        save_driver._write = die  # type: ignore[assignment]
    t0 = time.perf_counter()
    exc: BaseException | None = None
    try:
        if entry == "load_checkpoint":
            kw: dict[str, Any] = {"bucket_bytes": 1 << 12, "readers": readers}
            streamload.load_checkpoint(model, ckpt, device_mesh=mesh, progress=False, **kw)
        else:
            streamload.save_pretrained(model, out_dir, device_mesh=mesh, writers=readers)
    except BaseException as e:  # noqa: BLE001 - reported
        exc = e
    return _row(exc, t0)


def case_meeting_keys(rank: int, world: int) -> dict:
    """What the meeting relies on in torch: the default store and its operations."""
    store = arrival.default_store()
    return {"store": type(store).__name__, "ops": all(hasattr(store, op) for op in ("compare_set", "multi_get"))}


def case_store_stays_small(rank: int, world: int, *, ckpt: str) -> list[int]:
    """The store's key count after each of 6 loads: flat once two meetings are held."""
    mesh = _mesh(world)
    counts = []
    for _ in range(6):
        streamload.load_checkpoint(_MODEL["model"], ckpt, device_mesh=mesh, progress=False)
        dist.barrier()
        counts.append(arrival.default_store().num_keys())
    return counts


def _save_interrupted(
    rank: int, world: int, out_dir: str, where: Any, name: str, on_rank: int, **extra: Any
) -> dict:
    """``save_pretrained`` on every rank, ``where.name`` sending this process a SIGINT first on
    ``on_rank``; what each rank raised, and what the target's parent holds after."""
    mesh = _mesh(world)
    real = getattr(where, name)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    if rank == on_rank:
        setattr(where, name, interrupted)
    t0 = time.perf_counter()
    exc: BaseException | None = None
    try:
        streamload.save_pretrained(_MODEL["model"], out_dir, device_mesh=mesh)
    except BaseException as e:  # noqa: BLE001 - reported (KeyboardInterrupt included)
        exc = e
    finally:
        setattr(where, name, real)
    dist.barrier()
    row = _row(exc, t0, left=sorted(os.listdir(os.path.dirname(out_dir))), **extra)
    row["saved"] = os.path.exists(os.path.join(out_dir, "config.json"))
    row["handler_restored"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return row


def case_interrupt_during_save(rank: int, world: int, *, out_dir: str, victim: int) -> dict:
    """A Ctrl-C on ``victim`` while the save plans its writes: no rank commits; the victim
    raises KeyboardInterrupt, the others a SaveError naming it."""
    import streamload.save.driver as save_driver

    return _save_interrupted(rank, world, out_dir, save_driver, "plan_save", victim)


def case_interrupt_during_commit(rank: int, world: int, *, out_dir: str) -> dict:
    """A Ctrl-C on group rank 0 while it commits (before its rename): the save is made on every
    rank; rank 0 raises KeyboardInterrupt once the call is done, the others return normally."""
    from streamload.save import commit

    return _save_interrupted(rank, world, out_dir, commit.Output, "_commit", 0)
