from __future__ import annotations

import os

import pytest

# Tests are multi-process; keep each process from oversubscribing 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--runslow", action="store_true", help="also run tests marked slow (e.g. the full architecture sweep)"
    )


def pytest_collection_modifyitems(config, items) -> None:
    # Slow tests are opt-in, so README's plain `python -m pytest -q` stays fast.
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _group(world: int):
    from rank_group import RankGroup

    g = RankGroup(world)
    yield g
    g.close()


@pytest.fixture(scope="module")
def group2():
    """A 2-rank gloo group started once per test module (started only where a test asks)."""
    yield from _group(2)


@pytest.fixture(scope="module")
def group4():
    """A 4-rank gloo group started once per test module."""
    yield from _group(4)
