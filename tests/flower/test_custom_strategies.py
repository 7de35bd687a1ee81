"""Strategies of one's own, the Flower way: the app's own strategies (FedProx over shards, a per-round schedule, in
`llama_fl_hsdp.strategies`) on the fake grid and in a Flower simulation that imports them from the shipped app;
undeclared train keys and unsupported `start` arguments are refused."""

from __future__ import annotations

import json
import sys

import pytest
from flwr.app import ArrayRecord

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import messages as P
from flwr_sharded.flower.server.strategy import DecentralizedFedAvg
from tests.flower.conftest import run_demo
from tests.flower.procs import APP, FAST_RUN_CONFIG
from tests.flower.test_strategy import FakeGrid, config, fast, group, make, spec, task_identity

if str(APP) not in sys.path:
    sys.path.insert(0, str(APP))  # the app's directory, as Flower puts the shipped app on the ServerApp's path
from llama_fl_hsdp.strategies.fedprox import FedProxShards  # noqa: E402
from llama_fl_hsdp.strategies.schedule import ScheduledFedAvg  # noqa: E402

__all__ = ["task_identity"]  # the autouse fixture, imported to be active here


def grid3() -> FakeGrid:
    return FakeGrid({n: group(n, n - 1) for n in (1, 2, 3)})


def by_round(grid: FakeGrid) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for m in grid.sent(P.MSG_TRAIN):
        out.setdefault(config(m)["server-round"], []).append({**config(m), "node": m.metadata.dst_node_id})
    return out


def test_fedprox_asks_every_group_for_the_proximal_term():
    grid = grid3()
    make(spec(rounds=2), fast(num_groups=3), FedProxShards, proximal_mu=0.05).start(grid)
    rounds = by_round(grid)
    assert sorted(rounds) == [1, 2] and all(c["proximal-mu"] == 0.05 for r in rounds.values() for c in r)


def test_the_schedule_changes_a_the_learning_rate_and_the_members_from_round_to_round():
    grid = grid3()
    strategy = make(spec(rounds=4, aggregate_every=2, lr=0.01), fast(num_groups=3), ScheduledFedAvg, decay=0.5)
    strategy.start(grid)
    rounds = by_round(grid)
    assert [rounds[r][0]["aggregate-every"] for r in range(1, 5)] == [2, 4, 8, 16]
    assert [rounds[r][0]["lr"] for r in range(1, 5)] == pytest.approx([0.01, 0.005, 0.0025, 0.00125])
    assert [sorted(c["node"] for c in rounds[r]) for r in range(1, 5)] == [[1, 2, 3], [1, 2], [1, 2, 3], [1, 3]]
    assert all(c["members"] == [str(n) for n in sorted(x["node"] for x in rounds[r])] for r in rounds
               for c in rounds[r])
    records = [h for h in strategy.history if h["kind"] == "round"]
    assert [r["groups"] for r in records] == [3, 2, 3, 2] and strategy.membership.members == [1, 2, 3]


class Undeclared(DecentralizedFedAvg):
    def configure_train(self, server_round, arrays, config, grid):
        config["momentum-boost"] = 2.0
        return super().configure_train(server_round, arrays, config, grid)


def test_a_train_key_no_group_knows_is_refused_before_any_group_trains():
    grid = grid3()
    with pytest.raises(ConfigError, match="'momentum-boost' is not a round option"):
        make(spec(rounds=1), fast(num_groups=3), Undeclared).start(grid)
    assert grid.sent(P.MSG_TRAIN) == []
    assert len(grid.sent(P.MSG_FINISH)) == 3  # the groups are told the run is over


@pytest.mark.parametrize("kwargs,name", [({"initial_arrays": ArrayRecord()}, "initial_arrays"),
                                         ({"evaluate_fn": lambda r, a: None}, "evaluate_fn"),
                                         ({"evaluate_config": {"x": 1}}, "evaluate_config"),
                                         ({"train_config": {"warmup": 0.2}}, "'warmup' is not a round option")])
def test_unsupported_start_arguments_are_refused_not_ignored(kwargs, name):
    grid = grid3()
    with pytest.raises(ConfigError, match=name):
        make(spec(), fast(num_groups=3)).start(grid, **kwargs)
    assert grid.pushed == []


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_scheduled_strategy_drives_real_groups_in_simulation(data_dir, tmp_path):
    """The app's schedule strategy through `flwr run` (the ServerApp imports it from the shipped app, with nothing
    on PYTHONPATH for it): each round's steps follow its A, and the members of every round end with identical
    shards."""
    run = run_demo(tmp_path, data_dir, {**FAST_RUN_CONFIG, "num-server-rounds": 3, "aggregate-every": 2, "shards": 1,
                                        "strategy": "llama_fl_hsdp.strategies.schedule:ScheduledFedAvg"}, groups=3)
    assert run.returncode == 0, run.output[-4000:]
    K = FAST_RUN_CONFIG["syncs-per-round"]
    assert [r["steps"] for r in run.rounds] == [K * 2, K * 4, K * 8]
    assert [r["groups"] for r in run.rounds] == [3, 2, 3]
    assert all(r["synced"] and r["checksums_equal"] for r in run.rounds), run.rounds
    assert json.loads((run.run_dir / "config.json").read_text())["federation"]["strategy"].endswith("ScheduledFedAvg")
