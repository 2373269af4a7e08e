from __future__ import annotations

import os
import subprocess
from pathlib import Path

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


@pytest.fixture(scope="module")
def tiny_fs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 64 KiB tmpfs, where this process may mount one (root in a container that allows it)."""
    where = tmp_path_factory.mktemp("tiny")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): disk full is tested by injection"
        )
    yield where
    subprocess.run(["umount", str(where)], check=False)
