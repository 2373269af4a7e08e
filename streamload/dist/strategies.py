"""Reader strategies: one class per reader mode, each owning its groups and buffers (open / run / close)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from ..plan.buckets import build_plan
from .protocol import gather_or_raise
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

    Example:
        >>> strategy = make_strategy(prep.choice)
        >>> try:
        ...     strategy.open(prep)
        ...     result = strategy.run(prep)
        ... finally:
        ...     strategy.close()
    """

    def open(self, prep: Prepared) -> None: ...

    def run(self, prep: Prepared) -> StreamResult: ...

    def close(self) -> None: ...


class SrcScatter:
    """``src``: the designated reader packs every bucket and scatters it over the whole group."""

    def open(self, prep: Prepared) -> None:
        """Nothing to set up: the load's own group carries the buckets."""

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
            )
        )

    def close(self) -> None:
        """Nothing to give back."""


class OwnersRead:
    """``owners``: every rank reads its own shards from the files; no transport."""

    def open(self, prep: Prepared) -> None:
        """Nothing to set up: the group only carries the per-bucket status."""

    def run(self, prep: Prepared) -> StreamResult:
        return StreamResult(*read_owned(prep.plan, prep.source, prep.shards, prep.group_rank, prep.group, prep.device))

    def close(self) -> None:
        """Nothing to give back."""


class NodeScatter:
    """``node``: one reader per node scatters to the ranks of its node; nothing crosses nodes.

    The node groups are created once per node layout in ``open`` (every rank
    creates every node's group, as ``new_group`` requires) and destroyed in
    ``close``, so repeated loads do not accumulate process groups.
    """

    def __init__(self) -> None:
        self._layout: tuple[tuple[int, ...], ...] | None = None
        self._groups: list[dist.ProcessGroup] = []

    def open(self, prep: Prepared) -> None:
        assert prep.group is not None
        layout = tuple(tuple(ranks) for ranks in prep.choice.nodes)
        if layout == self._layout:
            return
        self.close()
        group = prep.group
        self._groups = [dist.new_group([dist.get_global_rank(group, r) for r in ranks]) for ranks in layout]
        self._layout = layout

    def run(self, prep: Prepared) -> StreamResult:
        assert prep.group is not None and self._layout is not None
        choice, group, group_rank = prep.choice, prep.group, prep.group_rank
        node = next(i for i, ranks in enumerate(choice.nodes) if group_rank in ranks)
        node_ranks, reader = choice.nodes[node], choice.node_readers[node]
        dtypes = {k: v[0] for k, v in prep.table.items()}
        node_placements = [prep.placements[r] for r in node_ranks]
        node_plan = build_plan(prep.match.targets, dtypes, node_placements, prep.bucket_bytes)
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
                )
            )
        except BaseException as exc:  # noqa: BLE001 - other nodes must hear of it too
            failure = exc
        gather_or_raise(None, failure, prep.rank, group, prep.device)  # nothing else crossed between nodes
        return result

    def close(self) -> None:
        """Destroys the node groups (every rank calls it, after the same last collective)."""
        groups, self._groups, self._layout = self._groups, [], None
        for g in groups:
            dist.destroy_process_group(g)


def make_strategy(choice: ReaderChoice) -> ReaderStrategy:
    """The strategy that runs ``choice.mode``."""
    if choice.mode is ReaderMode.OWNERS:
        return OwnersRead()
    if choice.mode is ReaderMode.NODE:
        return NodeScatter()
    return SrcScatter()
