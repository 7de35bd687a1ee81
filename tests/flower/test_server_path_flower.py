"""The server path through Flower (ServerShardFedAvg): shards travel through the ServerApp, facilities sync among
themselves, and the result equals the decentralised sync for the same inputs (fp32, local simulation)."""

from __future__ import annotations

import math

import pytest

from tests.flower.conftest import SimulationRun, run_demo, run_demo_killing_a_group
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


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_server_path_equals_the_decentralised_sync(data_dir, tmp_path):
    """Two groups of S = 2: the same losses, evaluation and shards after every round, with an outer optimizer.

    The chunks (`server-buffer-mb` 0.25: 256 KiB) are well below the model (about 1.1 MiB), so the shards travel
    both ways in chunks that cut the ranks' pieces at other rows."""
    reference = _ok(run_demo(tmp_path / "decentralized", data_dir, BASE), 2)
    run = run_demo(tmp_path / "server", data_dir, {**BASE, "aggregation": "server", "server-buffer-mb": 0.25})
    server = _ok(run, 2)
    assert "ServerShardFedAvg" in run.output
    for r in server:
        assert (r["facilities"], r["facility_replies"], r["facility_rejected"]) == (2, 2, 0), r
        assert r["server_sync_s"] > 0
        assert r["apply_chunks"] >= 4 and r["pull_chunks"] == 2 * r["apply_chunks"], r  # chunks <= 256 KiB fp32
    _compare(server, reference)
    assert server[-1]["eval_loss"] < server[0]["eval_loss"] + 0.5  # it trains (tiny run: no strict decrease)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_two_facilities_equal_a_flat_federation_of_their_groups(data_dir, tmp_path):
    """Facilities a = {0, 1}, b = {2}: all-reduce inside a, the server averages the two facility models (weighted
    by their tokens). With K = 1 that is the flat token-weighted average of the three groups. Groups of S = 1, so
    that the runs fit a small machine (rows cut across ranks: the tests above)."""
    config = {**BASE, "shards": 1}
    reference = _ok(run_demo(tmp_path / "flat", data_dir, config, groups=3), 2)
    run = run_demo(tmp_path / "facilities", data_dir, {**config, "aggregation": "server", "facilities": "a,a,b"},
                   groups=3)
    hierarchical = _ok(run, 2)
    for r in hierarchical:
        assert (r["facilities"], r["facility_replies"], r["groups"]) == (2, 2, 3), r
    _compare(hierarchical, reference)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_facilities_with_different_shard_counts_federate_through_the_server(data_dir, tmp_path):
    """Facility a runs S = 2, facility b S = 1 (`facility-shards`): the server combines their rows, and each rank
    assembles its own rows of the mean, so after every round both groups hold the same model (same held-out loss,
    evaluated over the same blocks, and the same parameter sum), whose sum is the weighted mean of the sums the
    facilities sent. The groups train on disjoint data (iid-groups). The decentralised path, with the same groups,
    ends every round with the same model."""
    config = {**BASE, "outer": "fedavg", "aggregation": "server", "facilities": "a,b", "facility-shards": "b=1",
              "partition": "iid-groups", "evaluate-in-train": True, "server-buffer-mb": 0.25}
    run = run_demo(tmp_path / "hetero", data_dir, config)
    rounds = _ok(run, 2)
    for r in rounds:
        assert (r["facilities"], r["facility_replies"], r["facility_rejected"]) == (2, 2, 0), r
        checksums = sorted(r["checksums"].values(), key=len)
        assert [len(c) for c in checksums] == [1, 2], r  # one rank in b, two in a
        losses = sorted(r["eval_losses"].values())
        assert len(losses) == 2 and math.isclose(losses[0], losses[1], rel_tol=1e-5), r
        assert math.isclose(sum(checksums[0]), sum(checksums[1]), rel_tol=1e-5), r  # the same parameters
        # ... and their sum is the token-weighted mean of the sums the two facilities sent (linearity)
        weights = r["facility_weights"]
        expected = sum(w * sum(r["train_checksums"][n]) for n, w in weights.items()) / sum(weights.values())
        assert len(weights) == 2 and math.isclose(sum(checksums[0]), expected, rel_tol=1e-6), (expected, r)
    # the decentralised path syncs the same groups shard to shard, piece by piece over their channels: the same
    # losses, held-out losses and parameters after every round
    shard_to_shard = {k: v for k, v in config.items() if k not in ("aggregation", "server-buffer-mb")}
    decentralised = _ok(run_demo(tmp_path / "decentralised", data_dir, shard_to_shard), 2)
    for s, d in zip(rounds, decentralised):
        assert _close(s["losses"], d["losses"]) and math.isclose(s["eval_loss"], d["eval_loss"], rel_tol=1e-5)
        by_layout = [sorted(x["checksums"].values(), key=len) for x in (s, d)]
        assert all(_close(a, b, 1e-4) for a, b in zip(*by_layout)), by_layout


def test_each_group_gets_the_shards_of_its_facility():
    from flwr_sharded.flower.run_config import FlowerRun

    run = FlowerRun.from_run_config({"aggregation": "server", "facilities": "a,b", "facility-shards": "b=1",
                                     "partition": "iid-groups"})
    run.validate()
    shards = [run.for_group(pid, facility).train.parallel.shards for pid, facility in ((0, ""), (1, ""), (0, "b"))]
    assert shards == [2, 1, 1]


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.slow  # a killed and relaunched group in a 3-group simulation (~50 s); the decentralised rejoin runs by default
def test_a_killed_group_rejoins_its_facility_with_a_catch_up(data_dir, tmp_path):
    """Facilities a = {0, 1}, b = {2} on the server path: kill -9 group 1 after round 1; it is dropped, then
    relaunched, and rejoins facility a after a catch-up from group 0, after which all three groups hold the same
    shards again every round."""
    config = {**BASE, "num-server-rounds": 4, "shards": 1, "aggregation": "server", "facilities": "a,a,b",
              "rendezvous-timeout": 10.0, "sync-timeout": 20.0}
    returncode, output, rounds, victim = run_demo_killing_a_group(tmp_path, data_dir, config, groups=3)
    assert returncode == 0, output[-4000:]
    assert len(rounds) == 4, output[-4000:]
    dropped = [r for r in rounds if r["dropped"]]
    rejoined = [r for r in rounds if r["rejoined"]]
    assert dropped and rejoined and rejoined[0]["round"] > dropped[0]["round"], rounds
    assert rejoined[0]["rejoined"] == [victim], rejoined
    for r in rounds[rounds.index(rejoined[0]):]:
        assert (r["groups"], r["facilities"], r["facility_replies"]) == (3, 2, 2), r
        assert r["synced"] == 1 and r["checksums_equal"] == 1, r


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.slow  # a third 3-group simulation (~1 min); the same checks: test_server_strategy.py
def test_a_hostile_facility_is_excluded_and_the_others_go_on(data_dir, tmp_path, monkeypatch):
    """Three groups (each its own facility, S = 1) on the server path, with a ServerApp that makes the last one
    hostile (`tests.flower.hostile_facility`): round 2 its manifest claims the weight 1e300, round 3 its first chunk
    holds a NaN. Each time it alone is left out, with one log line naming it, the round and why; the run finishes;
    every group (the hostile one too) adopts the token-weighted mean of the two others' models (parameter sums); in
    round 4 it is honest again and counted."""
    from tests.flower.procs import REPO

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("FLWR_SHARDED_ALLOWED_IMPORTS", "tests.flower.hostile_facility")  # the operator allows it
    config = {**BASE, "outer": "fedavg", "shards": 1, "num-server-rounds": 4, "aggregation": "server",
              "strategy": "tests.flower.hostile_facility:HostileFacility"}
    run = run_demo(tmp_path / "hostile", data_dir, config, groups=3)
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.rounds) == 4, run.output[-4000:]
    victim = run.rounds[0]["members"][-1]
    for r, reason in zip(run.rounds, ("", "out of bounds", "NaN or Inf", "")):
        assert r["synced"] == 1 and r["checksums_equal"] == 1 and r["dropped"] == 0, r
        if not reason:
            assert (r["facility_replies"], r["facility_rejected"]) == (3, 0), r
            continue
        assert (r["facility_replies"], r["facility_rejected"]) == (2, 1), r
        (source, why), = r["facility_rejections"].items()
        assert f"(node {victim})" in source and reason in why, r["facility_rejections"]
        lines = [line for line in run.output.splitlines() if f"{source}" in line and f"round {r['round']}:" in line]
        assert len(lines) == 1 and "server path: rejected the shards of" in lines[0] and reason in lines[0], lines
        weights = r["facility_weights"]
        assert victim not in weights and len(weights) == 2, weights
        expected = sum(w * sum(r["train_checksums"][n]) for n, w in weights.items()) / sum(weights.values())
        for sums in r["checksums"].values():
            assert math.isclose(sum(sums), expected, rel_tol=1e-6), (expected, r)
    print({r["round"]: (round(r["round_s"], 2), round(r["server_sync_s"], 2), r["stream_restarts"])
           for r in run.rounds})
