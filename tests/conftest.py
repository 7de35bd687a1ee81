"""Shared fixtures: a prepared data directory (the embedded corpus and tokenizer), reused across the session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """`$FLWR_SHARDED_TEST_DATA`, else `$FLWR_SHARDED_DATA` (set by the Makefile), else the repository's `.data`;
    prepared once (idempotent)."""
    from flwr_sharded.training.corpus import prepare_data

    path = Path(os.environ.get("FLWR_SHARDED_TEST_DATA") or os.environ.get("FLWR_SHARDED_DATA") or REPO / ".data")
    return prepare_data(path, progress=False)
