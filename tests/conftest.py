"""Shared fixtures: a prepared data directory (the embedded corpus and tokenizer), reused across the session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLOW_TESTS = os.environ.get("FLWR_SHARDED_SLOW_TESTS") == "1"
"""Run the tests marked `slow` too (`make test-slow`, which CI runs after `make test`)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked `slow` (kept out of `make test` for time) unless `FLWR_SHARDED_SLOW_TESTS=1`."""
    if SLOW_TESTS:
        return
    skip = pytest.mark.skip(reason="kept out of `make test` for time: `make test-slow` runs it (so does CI)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """`$FLWR_SHARDED_TEST_DATA`, else `$FLWR_SHARDED_DATA` (set by the Makefile), else the repository's `.data`;
    prepared once (idempotent)."""
    from flwr_sharded.training.corpus import prepare_data

    path = Path(os.environ.get("FLWR_SHARDED_TEST_DATA") or os.environ.get("FLWR_SHARDED_DATA") or REPO / ".data")
    return prepare_data(path, progress=False)
