from __future__ import annotations

import os

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
    import pytest

    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
