"""Reader strategies: one class per reader mode, each owning its groups and buffers (open / run / close)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from .protocol import StatusRoute, close_route, open_status_route
from .readers import ReaderChoice, ReaderMode
from .stream import read_owned, scatter

if TYPE_CHECKING:
    from ..load.prepare import Prepared


@dataclass
class StreamResult:
    """What running the plan cost this rank."""

    peak_staging_bytes: int
    bytes_read: int


class ReaderStrategy(Protocol):
    """Runs a prepared plan: ``open`` takes what it needs (groups), ``close`` gives it back.

    ``prepare`` calls ``open`` inside its last agreement, on every rank, even on
    one whose planning failed (the collective sequence must stay the same on
    every rank), so a failure in it raises on every rank before the first weight byte.

    Example:
        >>> strategy = make_strategy(prep.choice)
        >>> strategy.open(prep.choice, prep.group, prep.device)
        >>> try:
        ...     result = strategy.run(prep)
        ... finally:
        ...     strategy.close()
    """

    def open(self, choice: ReaderChoice, group: dist.ProcessGroup | None, device: torch.device) -> None: ...

    def run(self, prep: Prepared) -> StreamResult: ...

    def close(self) -> None: ...


class _Routed:
    """Opens the load's status route in ``open`` (on NCCL, a gloo side group for this
    load only, so the per-bucket check never waits for the device) and closes it in ``close``."""

    def __init__(self) -> None:
        self._route: StatusRoute | None = None

    def open(self, choice: ReaderChoice, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self._route = open_status_route(group, device)

    def close(self) -> None:
        """Destroys the side group, if this load created one (``close_route``: a failure is a warning)."""
        route, self._route = self._route, None
        if route is not None:
            close_route(route)


class SrcScatter(_Routed):
    """``src``: the designated reader packs every bucket and scatters it over the whole group."""

    def run(self, prep: Prepared) -> StreamResult:
        source = prep.source if prep.rank == prep.options.src_rank else None
        return StreamResult(
            *scatter(
                prep.plan,
                prep.group_rank,
                prep.src_group_rank,
                prep.options.src_rank,
                prep.group,
                prep.device,
                source,
                prep.shards,
                self._route,
                prep.served,
            )
        )


class OwnersRead(_Routed):
    """``owners``: every rank reads its own shards from the files; no transport."""

    def run(self, prep: Prepared) -> StreamResult:
        return StreamResult(
            *read_owned(
                prep.plan,
                prep.source,
                prep.shards,
                prep.group_rank,
                prep.group,
                prep.device,
                self._route,
                row=prep.plan_rank,
            )
        )


class NodeScatter(_Routed):
    """``node``: one reader per node scatters to the ranks of its node; nothing crosses nodes.

    Every bucket is one ``all_to_all_single`` over the load's own group, in which each
    node's reader sends to the ranks of its node and every other split is zero-length;
    the status flags travel on the load's route, as in ``src``. No process group is
    created, on purpose:

    - ``new_group`` names its groups from a world-wide counter that only its callers
      advance. A load over part of the world (a pipeline stage, ``mesh["dp"]`` under
      TP/EP) that created node groups on its members alone left that counter behind on
      the other ranks, and the next world-wide ``new_group`` hung on every rank. The
      hashed names of ``use_local_synchronization`` repeat when the same ranks create a
      group again after a ``destroy_process_group`` (its store keys are reused), and the
      explicit-name path is private; on NCCL a subgroup is split from the world's
      communicator, which every rank of the world must enter anyway.
    - The load's group already has its communicator; a node group costs one more
      rendezvous (and on NCCL one communicator init) per node per load.
    - Bytes move only from each node's reader to the ranks of its node; every other
      leg of the all_to_all is zero-length (the legs ``src`` already posts between its
      receivers), so a bucket moves the same bytes as a scatter over the node would.
      Nodes step through the buckets together (every node pads its plan to the most
      buckets any node has), one status flag per bucket, as ``src`` and ``owners`` do.
    - Rows of the node's plan are group ranks of the load's group, sent in group rank
      order: no rank order of another group can disagree with the plan's.
    """

    def run(self, prep: Prepared) -> StreamResult:
        assert prep.group is not None
        choice, group_rank = prep.choice, prep.group_rank
        node = next(i for i, ranks in enumerate(choice.nodes) if group_rank in ranks)
        node_ranks, reader = choice.nodes[node], choice.node_readers[node]
        assert prep.served == list(node_ranks)  # planned over this node's ranks only (see served_ranks)
        return StreamResult(
            *scatter(
                prep.plan,
                group_rank,
                reader,
                dist.get_global_rank(prep.group, reader),
                prep.group,
                prep.device,
                prep.source if group_rank == reader else None,
                prep.shards,
                self._route,
                prep.served,
            )
        )


def make_strategy(choice: ReaderChoice) -> ReaderStrategy:
    """The strategy that runs ``choice.mode``."""
    if choice.mode is ReaderMode.OWNERS:
        return OwnersRead()
    if choice.mode is ReaderMode.NODE:
        return NodeScatter()
    return SrcScatter()
