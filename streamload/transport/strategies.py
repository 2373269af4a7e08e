"""Reader strategies: one class per reader mode, each owning its groups and buffers (open / run / close)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from . import protocol
from .protocol import StatusRoute, gather_or_raise, open_status_route
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
        """Destroys the side group, if this load created one. A failure to is a warning: the
        ranks agreed on the load's outcome before (raising here on one rank would leave the
        others waiting in the next agreement), and a group left behind costs memory only."""
        route, self._route = self._route, None
        if route is not None:
            try:
                route.close()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                warnings.warn(f"streamload: the load's status group was not destroyed: {exc}", stacklevel=2)


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


class NodeScatter:
    """``node``: one reader per node scatters to the ranks of its node; nothing crosses nodes.

    The node groups are created once per node layout in ``open`` (every rank
    creates every node's group, as ``new_group`` requires) and destroyed in
    ``close``, so repeated loads do not accumulate process groups.
    """

    def __init__(self) -> None:
        self._layout: tuple[tuple[int, ...], ...] | None = None
        self._groups: list[dist.ProcessGroup] = []
        self._sides: list[dist.ProcessGroup] = []  # gloo twins of the node groups (NCCL only)

    def open(self, choice: ReaderChoice, group: dist.ProcessGroup | None, device: torch.device) -> None:
        """Creates every node's group (``new_group`` is collective over the whole world).

        Each creation is attempted even after an earlier one failed here, so the
        other ranks are never left waiting in a ``new_group`` this rank skipped;
        the first failure is raised at the end. (A failure inside torch's own
        ``new_group`` on one rank is a transport failure: the others wait for it
        as for any collective, up to the group's timeout.)
        """
        assert group is not None
        layout = tuple(tuple(ranks) for ranks in choice.nodes)
        if layout == self._layout:
            return
        self.close()
        members = [[dist.get_global_rank(group, r) for r in ranks] for ranks in layout]
        # Node groups take the default backend: without a CPU part, their status flags need twins.
        sides = protocol.needs_side_group(None, device)
        failure: BaseException | None = None
        for m in members:
            try:
                self._groups.append(node_group(m))
                if sides:
                    self._sides.append(node_group(m, backend="gloo"))
            except BaseException as exc:  # noqa: BLE001 - raised after every group was attempted
                failure = failure or exc
        self._layout = layout
        if failure is not None:
            raise failure

    def run(self, prep: Prepared) -> StreamResult:
        assert prep.group is not None and self._layout is not None
        choice, group, group_rank = prep.choice, prep.group, prep.group_rank
        node = next(i for i, ranks in enumerate(choice.nodes) if group_rank in ranks)
        node_ranks, reader = choice.nodes[node], choice.node_readers[node]
        node_plan = prep.plan  # planned over this node's ranks only (see served_ranks)
        assert prep.served == list(node_ranks)
        failure: BaseException | None = None
        result = StreamResult(0, 0)
        try:
            result = StreamResult(
                *scatter(
                    node_plan,
                    node_ranks.index(group_rank),
                    node_ranks.index(reader),
                    dist.get_global_rank(group, reader),
                    self._groups[node],
                    prep.device,
                    prep.source if group_rank == reader else None,
                    prep.shards,
                    StatusRoute(self._sides[node], torch.device("cpu")) if self._sides else None,
                )
            )
        except BaseException as exc:  # noqa: BLE001 - other nodes must hear of it too
            failure = exc
        gather_or_raise(None, failure, prep.rank, group, prep.device)  # nothing else crossed between nodes
        return result

    def close(self) -> None:
        """Destroys the node groups (every rank calls it, after the same last collective)."""
        groups, self._groups, self._layout = self._groups + self._sides, [], None
        self._sides = []
        for g in groups:
            dist.destroy_process_group(g)


def node_group(global_ranks: list[int], backend: str | None = None) -> dist.ProcessGroup:
    """One node's process group (a seam the fault-injection tests replace)."""
    return dist.new_group(global_ranks, backend=backend)


def make_strategy(choice: ReaderChoice) -> ReaderStrategy:
    """The strategy that runs ``choice.mode``."""
    if choice.mode is ReaderMode.OWNERS:
        return OwnersRead()
    if choice.mode is ReaderMode.NODE:
        return NodeScatter()
    return SrcScatter()
