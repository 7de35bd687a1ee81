"""Shared fixtures: a prepared data directory (the embedded corpus and tokenizer), reused across the session; and the
tiers: a test that starts processes is marked `dist` (`make test-fast` runs the others), which is enforced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import REPO

SLOW_TESTS = os.environ.get("FLWR_SHARDED_SLOW_TESTS") == "1"
"""Run the tests marked `slow` too (`make test-slow`, which CI runs after `make test`)."""


SHARED_RESOURCE = {"tests/flower/test_custom_strategies.py": "flower-simulation",
                   "tests/flower/test_deployment.py": "flower-simulation",
                   "tests/flower/test_flwr_run.py": "flower-simulation",
                   "tests/flower/test_server_path_flower.py": "flower-simulation",
                   "tests/flower/test_simulation.py": "flower-simulation",
                   "tests/flower/test_superlink_restart.py": "flower-simulation",
                   "tests/flower/test_unequal_groups.py": "flower-simulation",
                   "tests/perf/test_bench.py": "netemu", "tests/perf/test_bench_unequal.py": "netemu",
                   "tests/perf/test_netemu.py": "netemu"}
"""Files whose multi-process tests share a machine-wide resource, run one after the other in one pytest-xdist worker
(`make test` runs two, `--dist loadgroup`): the Flower simulations (a local Ray cluster each) and the emulated
network's namespaces (its tests count the emulator's processes); test_deployment.py compares with the session's
simulation run (tests/flower/conftest.py), built once in the worker of that group. Any other file's multi-process
tests run in one worker too (its module-scoped fixtures, such as a deployment, are built once); in-process tests go
anywhere."""


def pytest_itemcollected(item: pytest.Item) -> None:
    """Put each multi-process test in its xdist group (`SHARED_RESOURCE`, else its file's), as it is collected:
    pytest-xdist reads the groups when the collection is modified."""
    if "dist" in item.keywords or "slow" in item.keywords:
        where = item.path.relative_to(REPO).as_posix()
        item.add_marker(pytest.mark.xdist_group(SHARED_RESOURCE.get(where, where)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked `slow` (kept out of `make test` for time) unless `FLWR_SHARDED_SLOW_TESTS=1`."""
    if SLOW_TESTS:
        return
    skip = pytest.mark.skip(reason="kept out of `make test` for time: `make test-slow` runs it (so does CI)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _in_process_unless_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked `dist` (or `slow`) runs in this process: starting one fails it, naming the marker."""
    if request.node.get_closest_marker("dist") or request.node.get_closest_marker("slow"):
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.dist (the fast tier, "
                           f"`make test-fast`, runs in-process tests only)")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """`$FLWR_SHARDED_TEST_DATA`, else `$FLWR_SHARDED_DATA` (set by the Makefile), else the repository's `.data`;
    prepared once (idempotent)."""
    from flwr_sharded.training.corpus import prepare_data

    path = Path(os.environ.get("FLWR_SHARDED_TEST_DATA") or os.environ.get("FLWR_SHARDED_DATA") or REPO / ".data")
    return prepare_data(path, progress=False)
