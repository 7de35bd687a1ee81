"""The server path through Flower (ServerShardFedAvg): shards travel through the ServerApp, facilities sync among
themselves, and the result equals the decentralised sync for the same inputs (fp32, local simulation)."""

from __future__ import annotations

import math

import pytest

from tests.flower.conftest import SimulationRun, run_demo
from tests.flower.procs import FAST_RUN_CONFIG

# One sync per round (K = 1), so the server path and the decentralised path average at the same steps; Nesterov,
# so the outer step (run by each rank on its own shards on the server path) is checked too.
BASE = {**FAST_RUN_CONFIG, "syncs-per-round": 1, "aggregate-every": 3, "num-server-rounds": 2, "outer": "nesterov"}


def _ok(run: SimulationRun, rounds: int) -> list[dict]:
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.rounds) == rounds, run.output[-4000:]
    for r in run.rounds:
        assert r["synced"] == 1 and r["checksums_equal"] == 1 and r["dropped"] == 0, r
    return run.rounds


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a, b))


def _compare(server: list[dict], reference: list[dict]) -> None:
    for s, r in zip(server, reference):
        assert _close(s["losses"], r["losses"]), (s["losses"], r["losses"])
        assert math.isclose(s["eval_loss"], r["eval_loss"], rel_tol=1e-5)
        s_sums, r_sums = next(iter(s["checksums"].values())), next(iter(r["checksums"].values()))
        assert _close(s_sums, r_sums, 1e-4), (s_sums, r_sums)


@pytest.mark.timeout(900)
def test_server_path_equals_the_decentralised_sync(data_dir, tmp_path):
    """Two groups of S = 2: the same losses, evaluation and shards after every round, with an outer optimizer."""
    reference = _ok(run_demo(tmp_path / "decentralized", data_dir, BASE), 2)
    run = run_demo(tmp_path / "server", data_dir, {**BASE, "aggregation": "server"})
    server = _ok(run, 2)
    assert "ServerShardFedAvg" in run.output
    for r in server:
        assert (r["facilities"], r["facility_replies"], r["facility_rejected"]) == (2, 2, 0), r
        assert r["server_sync_s"] > 0
    _compare(server, reference)
    assert server[-1]["eval_loss"] < server[0]["eval_loss"] + 0.5  # it trains (tiny run: no strict decrease)


@pytest.mark.timeout(900)
def test_two_facilities_of_two_groups_equal_a_flat_federation_of_four(data_dir, tmp_path):
    """Facilities a = {0, 1}, b = {2, 3}: all-reduce inside each, the server averages the two facility models
    (weighted by their tokens). With K = 1 that is the flat token-weighted average of the four groups."""
    reference = _ok(run_demo(tmp_path / "flat", data_dir, BASE, groups=4), 2)
    run = run_demo(tmp_path / "facilities", data_dir, {**BASE, "aggregation": "server", "facilities": "a,a,b,b"},
                   groups=4)
    hierarchical = _ok(run, 2)
    for r in hierarchical:
        assert (r["facilities"], r["facility_replies"], r["groups"]) == (2, 2, 4), r
    _compare(hierarchical, reference)
