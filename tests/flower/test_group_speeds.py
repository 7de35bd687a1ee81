"""Groups of different speeds in one decentralised Flower run (`group-steps speed`): the strategy gives each member
its local steps per sync from its last round's step time (fake nodes, no processes), the run config refuses what
needs equal steps, and two groups train their own steps in one round, both ending on one model and one clock."""

from __future__ import annotations

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import messages as P
from flwr_sharded.flower.run_config import FlowerRun
from flwr_sharded.flower.server import records
from tests.flower.procs import start_groups
from tests.flower.test_group import client, hello, round_args, spec
from tests.multiproc import faults_env
from tests.flower.test_strategy import task_identity  # noqa: F401  (a fixture: Flower messages outside a run)


def test_the_strategy_gives_a_member_twice_as_slow_half_the_steps_from_its_second_round():
    from tests.flower.test_strategy import FakeGrid, config, fast, group, make, spec as run, train_ok

    def train_of(step_s: float):  # a group that reports the steps the round gave it, at `step_s` per step
        def answer(m, n):
            steps = P.TrainArgs.from_config(config(m)).local_steps(4) * 2
            return 0.0, train_ok(steps=steps, train_s=steps * step_s, sync_s=0.5 + step_s * (8 - steps),
                                 local_steps=steps // 2, losses=[2.0] * steps, tokens=100 * steps)
        return answer

    grid = FakeGrid({1: group(1, 0, train=train_of(0.1)), 2: group(2, 1, train=train_of(0.2))})
    strategy = make(run(aggregate_every=4, group_steps="speed", rounds=3), fast(min_groups=2))
    strategy.start(grid)
    sent = [config(m).get("member-steps") for m in grid.sent(P.MSG_TRAIN)]
    assert sent == [None, None, [4, 2], [4, 2], [4, 2], [4, 2]]  # round 1 measures: every member A
    first, second, _ = [h for h in strategy.history if h.get("kind") == "round"]
    assert "member_steps" not in first and second["member_steps"] == {"1": 4, "2": 2}
    assert first["idle_s_per_sync"] == pytest.approx({"1": 0.0, "2": 0.0})  # fake sync times: 0.5 + what is left
    assert second["train_loss"] == pytest.approx(2.0) and second["tokens"] == 800 + 400

    grid = FakeGrid({1: group(1, 0, train=train_of(0.1)), 2: group(2, 1, train=train_of(0.2))})
    make(run(aggregate_every=4, rounds=2), fast(min_groups=2)).start(grid)  # the default: equal steps
    assert all("member-steps" not in config(m) for m in grid.sent(P.MSG_TRAIN))


def test_idle_time_per_sync_is_each_members_wait_beyond_the_shortest():
    replies = {1: {"sync_s": 3.0, "syncs": 2, "train_s": 4.0, "steps": 8},
               2: {"sync_s": 1.0, "syncs": 2, "train_s": 6.0, "steps": 4}, 3: {"sync_s": 9.0, "syncs": 0}}
    assert records.member_timings(replies) == {"step_s": {"1": 0.5, "2": 1.5}, "sync_period_s": {"1": 3.5, "2": 3.5},
                                               "idle_s_per_sync": {"1": 1.0, "2": 0.0}}
    assert records.member_timings({1: replies[1]}) == {}


@pytest.mark.parametrize("keys,message", [
    ({"aggregation": "server"}, "'group-steps' applies to the decentralized all-reduce"),
    ({"outer": "median"}, "ignores the weights"),
    ({"sync-fragments": 2}, "use one fragment and no delay"),
])
def test_the_run_config_refuses_group_steps_speed_with_what_needs_equal_steps(keys, message):
    FlowerRun.from_run_config({"group-steps": "speed"}).validate()
    with pytest.raises(ConfigError, match=message):
        FlowerRun.from_run_config({"group-steps": "speed", **keys}).validate()


def test_member_steps_must_name_every_member():
    args = round_args({"rendezvous_host": "h", "rendezvous_ports": [1]}, "p", 0, 2, member_steps=[4])
    with pytest.raises(P.ArgumentError, match=r"member-steps \[4\] must name the local steps of each of the 2"):
        P.TrainArgs.from_config(args)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_groups_train_their_own_steps_and_end_the_round_on_one_model_and_one_clock(procs, data_dir):
    """Two groups of one rank, the second sleeping 0.2 s after each step; a round of K = 2 syncs with member steps
    [4, 2]: each trains its own steps, neither is left out (the slower group admits the faster one's 4 steps of
    tokens), both hold one model after every sync, and the slower group's learning-rate schedule follows the faster
    one's clock. A second round with a catch-up leaves both on member 0's clock."""
    s = spec(data_dir, shards=1, aggregate_every=4, group_steps="speed", partition="iid-groups")
    (_, a_addr, a_key), (_, b_addr, b_key) = start_groups(procs, [
        ("a", dict(shards=1)), ("b", dict(shards=1, env=faults_env(step_delay=0.2)))])
    a, b = client(a_addr, a_key), client(b_addr, b_key)
    offer, _ = hello(a, s, 0, 2), hello(b, s, 1, 2)

    def train_round(prefix: str, **flags) -> list[dict]:
        jobs = [c.call(P.TRAIN, round_args(offer, prefix, i, 2, syncs=2, steps=4, member_steps=[4, 2], **flags),
                       timeout=30, detach=True)["job"] for i, c in enumerate((a, b))]
        out = [c.collect(job, timeout=240) for c, job in zip((a, b), jobs)]
        for o in out:
            assert o is not None and not o["sync_failed"], out
        return out

    fast, slow = train_round("speeds/round1")
    assert (fast["steps"], slow["steps"]) == (8, 4) and (fast["local_steps"], slow["local_steps"]) == (4, 2)
    assert fast["tokens"] == 2 * slow["tokens"]
    assert fast["sync_left_out"] == slow["sync_left_out"] == []
    assert fast["checksums"] == slow["checksums"] and len(fast["checksums"]) == 2
    assert slow["train_s"] / slow["steps"] > 0.2 > fast["train_s"] / fast["steps"]
    assert slow["lr"] == fast["lr"] and (slow["step"], fast["step"]) == (4, 8)
    fast, slow = train_round("speeds/round2", catch_up=True)
    assert slow["catch_up_checksums"] == fast["catch_up_checksums"] and slow["lr"] == fast["lr"]
    assert (fast["step"], slow["step"]) == (16, 12)  # both from member 0's clock (8): 8 and 4 steps
