"""Cases for loads over part of the world, permuted meshes and replaced files
(run in the rank group, see rank_group.py; tests/test_subgroups.py drives them).

Every case ends with ``world_group_works``: a world-wide ``new_group`` and an
all-reduce on it. A load that created groups on its own members only leaves
torch's group counter behind on the other ranks, and that ``new_group`` then
hangs; the counters are compared first (over the default group, which needs no
new group), so such a regression fails at once with the counters in its message.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cases_load import MISSING_PATH, compare_model, reference

import streamload
import streamload.load.prepare as sl_prepare

_GROUPS: dict[tuple[tuple[int, ...], bool], Any] = {}


def world_created_group(ranks: list[int], sort: bool = True) -> Any:
    """A group over ``ranks`` that every rank of the world creates (as ``new_group`` requires),
    once per module; None on ranks outside it."""
    key = (tuple(ranks), sort)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), sort_ranks=sort)
    return _GROUPS[key] if dist.get_rank() in ranks else None


def group_counter() -> int:
    """torch's world-wide group counter (a private table: fail loudly if torch renames it)."""
    c10d = dist.distributed_c10d
    assert hasattr(c10d._world, "group_count"), (
        "distributed_c10d._world.group_count is gone: update this check"
    )
    return int(c10d._world.group_count)


def world_group_works() -> dict[str, Any]:
    """Every rank's group counter agrees, then a new world-wide group all-reduces."""
    counters: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counters, group_counter())
    assert len(set(counters)) == 1, f"torch's group counters differ between ranks: {counters}"
    g = dist.new_group(list(range(dist.get_world_size())))
    try:
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        assert t.item() == dist.get_world_size(), t
    finally:
        dist.destroy_process_group(g)
    return {"counters": counters}


@contextmanager
def simulated_node(name: str | None) -> Iterator[None]:
    """STREAMLOAD_NODE set to ``name`` (None: unset) for the block."""
    before = os.environ.get("STREAMLOAD_NODE")
    if name is None:
        os.environ.pop("STREAMLOAD_NODE", None)
    else:
        os.environ["STREAMLOAD_NODE"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("STREAMLOAD_NODE", None)
        else:
            os.environ["STREAMLOAD_NODE"] = before


def _load(
    ckpt: str, mesh: Any, src_rank: int, path: str, readers: str, node: str | None, loads: int
) -> list[dict[str, Any]]:
    """``loads`` from_pretrained loads over ``mesh``, each compared bit for bit with transformers."""
    ref = reference(ckpt, None)
    out = []
    with simulated_node(node):
        for _ in range(loads):
            model = streamload.from_pretrained(
                path, device_mesh=mesh, src_rank=src_rank, bucket_bytes=4096, progress=False, readers=readers
            )
            bad = compare_model(model, ref)
            assert not bad, f"differ from transformers: {bad}"
            out.append(model.streamload_report.to_dict())
            del model
    return out


def case_node_loads_over_subgroups(
    rank: int,
    world: int,
    *,
    ckpt: str,
    member_sets: list[list[int]],
    nodes: int = 2,
    loads: int = 1,
    readers: str = "node",
) -> dict[str, Any]:
    """Each member set (disjoint subgroups, e.g. pipeline stages) loads at the same time in
    node mode, ``nodes`` simulated nodes per set (the first member of each sees the files);
    then the world creates a group and all-reduces on it."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = [world_created_group(m) for m in member_sets]
    reports: list[dict[str, Any]] = []
    for members, group in zip(member_sets, groups, strict=True):
        if group is None:
            continue
        i = dist.get_group_rank(group, rank)
        node = i * nodes // len(members)
        first = i == 0 or (i - 1) * nodes // len(members) != node
        tag = "-".join(map(str, members))  # node names of different sets never meet
        reports = _load(
            ckpt,
            DeviceMesh.from_group(group, "cpu"),
            dist.get_global_rank(group, 0),
            ckpt if first else MISSING_PATH,
            readers,
            f"{tag}:{node}",
            loads,
        )
        if len(members) > 1:  # one process reads alone
            assert all(r["reader"].startswith("node") for r in reports), [r["reader"] for r in reports]
    return {"reports": reports, **world_group_works()}


def case_node_load_on_permuted_mesh(
    rank: int,
    world: int,
    *,
    ckpt: str,
    mesh_ranks: list[Any],
    dims: tuple[str, ...] = ("dp",),
    load_dim: str = "dp",
    unsorted_group: bool = False,
    readers: str = "node",
) -> dict[str, Any]:
    """A node-mode load over a mesh whose ranks are permuted: ``DeviceMesh("cpu", tensor)``
    (its ``load_dim`` submesh when 2-D), or a group created with ``sort_ranks=False`` (group
    rank order is not global rank order). Nodes are global rank pairs {0, 1} and {2, 3}
    (where the processes run); every rank sees the files.

    torch 2.13's DeviceMesh builds each dimension's group with sorted ranks (the whole
    world's: the default group), and ``fully_shard`` shards by that group's rank while
    DTensor places by mesh coordinate: where the two orders differ the model's own shards
    contradict their placements. The load must then refuse on every rank, naming it
    (``error``), never load wrong bytes or hang.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if unsorted_group:
        order = [int(r) for r in torch.tensor(mesh_ranks).flatten()]
        group = world_created_group(order, sort=False)
        if group is None:  # not a member: only the world-wide group below
            return {"reports": [], "error": None, "ordered": True, "group_ranks": [], **world_group_works()}
        assert dist.get_process_group_ranks(group) == order, dist.get_process_group_ranks(group)
        mesh = DeviceMesh.from_group(group, "cpu")
    else:
        mesh = DeviceMesh("cpu", torch.tensor(mesh_ranks), mesh_dim_names=dims)
        mesh = mesh[load_dim] if len(dims) > 1 else mesh
    group = mesh.get_group()
    ordered = dist.get_process_group_ranks(group) == mesh.mesh.flatten().tolist()
    src = dist.get_global_rank(group, 0)
    reports: list[dict[str, Any]] = []
    error = None
    try:
        reports = _load(ckpt, mesh, src, ckpt, readers, f"host{rank // 2}", 1)
        assert all(r["reader"].startswith("node") for r in reports), [r["reader"] for r in reports]
    except streamload.PlacementError as exc:
        error = str(exc)
    return {
        "reports": reports,
        "error": error,
        "ordered": ordered,
        "group_ranks": dist.get_process_group_ranks(group),
        **world_group_works(),
    }


def replace_shard(ckpt: str, scale: float = 2.0) -> str:
    """Writes new values into the checkpoint's largest shard (same names, shapes and dtypes,
    so the header and tensor table agree) and renames it over the old one; returns its name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    victim = max(Path(ckpt).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with safe_open(str(victim), "pt") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) * scale + 1 for k in f.keys()}
    tmp = victim.with_suffix(".new")
    save_file(state, str(tmp), metadata=meta)
    os.replace(tmp, victim)
    return victim.name


def case_files_replaced_while_choosing(
    rank: int, world: int, *, ckpt: str, old: str, new: str, when: str, nodes: bool = False
) -> dict[str, Any]:
    """``auto`` over the whole world, every rank given the same directory ``ckpt``, and one
    shard replaced (new bytes, ``os.replace``) by rank 0 at ``when``:

    - ``"before_choice"``: after the reader opened its files, before the ranks compare identities;
    - ``"after_choice"``: after they agreed, before the other ranks open their files;
    - ``"never"``: not replaced (the control: the same files throughout).

    ``old`` and ``new`` are pristine copies of the checkpoint before and after the change.
    The load must be one version throughout, never a mix of the two. ``nodes``: two simulated
    nodes ({0, 1} and {2, 3}) where ranks 0 and 2 see the files, so ``auto`` picks ``node``.
    """
    real_choose: Callable[..., Any] = sl_prepare.choose

    def choose(*args: Any, **kwargs: Any) -> Any:
        if when == "before_choice":
            if rank == 0:
                replace_shard(ckpt)
            dist.barrier()
        choice = real_choose(*args, **kwargs)
        if when == "after_choice":
            dist.barrier()
            if rank == 0:
                replace_shard(ckpt)
            dist.barrier()
        return choice

    sl_prepare.choose = choose  # type: ignore[assignment]
    path = MISSING_PATH if nodes and rank % 2 else ckpt
    try:
        with warnings.catch_warnings(), simulated_node(f"host{rank // 2}" if nodes else None):
            warnings.simplefilter("ignore")
            model = streamload.from_pretrained(path, bucket_bytes=4096, progress=False, readers="auto")
    finally:
        sl_prepare.choose = real_choose  # type: ignore[assignment]
    wrong = {v: compare_model(model, reference(path, None)) for v, path in (("old", old), ("new", new))}
    assert not wrong["old"] or not wrong["new"], f"a mix of two versions: differs from old {wrong['old']}"
    return {"reader": model.streamload_report.reader, "version": "old" if not wrong["old"] else "new"}


def case_failure_names_the_global_rank(
    rank: int, world: int, *, ckpt: str, members: list[int], failing: int, readers: str
) -> dict[str, Any] | None:
    """A load over ``members`` in which global rank ``failing`` raises while unpacking its
    first bucket (``src``/``node``) or packing it (``owners``); returns the error's rank."""
    from torch.distributed.device_mesh import DeviceMesh

    import streamload.transport.pack as sl_pack
    import streamload.transport.stream as sl_stream

    group = world_created_group(members)
    if group is None:
        return {"rank": None, **world_group_works()}
    real_unpack, real_pack = sl_stream.unpack, sl_pack.Packer.pack

    def unpack(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected failure unpacking on rank {rank}")

    def pack(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected failure packing on rank {rank}")

    if rank == failing:
        sl_stream.unpack = unpack  # type: ignore[assignment]
        sl_pack.Packer.pack = pack  # type: ignore[method-assign]
    raised: Any = None
    try:
        with simulated_node(f"host{rank // 2}"):
            streamload.from_pretrained(
                ckpt,
                device_mesh=DeviceMesh.from_group(group, "cpu"),
                src_rank=members[0],
                bucket_bytes=4096,
                progress=False,
                readers=readers,
            )
    except Exception as exc:  # noqa: BLE001 - which error, and which rank it names, is the point
        raised = (type(exc).__name__, getattr(exc, "rank", None), str(exc)[:300])
    finally:
        sl_stream.unpack, sl_pack.Packer.pack = real_unpack, real_pack  # type: ignore[method-assign]
    return {"raised": raised, **world_group_works()}
