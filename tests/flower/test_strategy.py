"""DecentralizedFedAvg against an in-process fake Grid: sampling deadlines, hello exclusions, failed syncs, lost nodes.

No processes: each fake node answers each message with a scripted reply (or none) after a scripted delay. A round's
train message is acknowledged at once and its collect message gets the node's scripted train result, as the
ClientApp does.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import messages as P
from flwr_sharded.flower.run_config import FlowerRun
from flwr_sharded.flower.server.grid import Polling
from flwr_sharded.flower.server.strategy import DecentralizedFedAvg

Behaviour = Callable[[Message], "tuple[float, RecordDict | Error | None]"]


@pytest.fixture(autouse=True)
def task_identity():
    """Flower's task identity, which creating a Message needs outside a run."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class _Run:
    run_id = 1


class FakeGrid(Grid):
    def __init__(self, nodes: dict[int, Behaviour]) -> None:
        self.nodes = nodes
        self.offline_at: dict[int, float] = {}
        self.pushed: list[Message] = []
        self._replies: dict[str, tuple[float, Message]] = {}
        self._started: dict[tuple[int, str], Message] = {}
        self.running: dict[tuple[int, str], tuple[float, RecordDict | Error | None]] = {}
        """(node, job) -> (when its round ends, its result): rounds a collect asked for that still run."""

    def set_run(self, run: Any) -> None:
        pass

    @property
    def run(self) -> Any:
        return _Run()

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        raise NotImplementedError

    def get_node_ids(self) -> list[int]:
        now = time.monotonic()
        return [n for n in self.nodes if self.offline_at.get(n, math.inf) > now]

    def push_messages(self, messages):
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            self.pushed.append(m)
            node, kind = m.metadata.dst_node_id, m.metadata.message_type
            if kind == P.MSG_TRAIN:  # the round starts; its result goes to the collect message
                self._started[(node, config(m)["job"])] = m
                delay, content = 0.0, reply(job=config(m)["job"])
            elif kind == P.MSG_COLLECT:  # the round's result if it ends within the collect's wait, else pending
                key, now = (node, config(m)["job"]), time.monotonic()
                train = self._started.pop(key, None)
                if train is not None:
                    delay, content = self.nodes[node](train)
                    self.running[key] = (now + delay, content)
                if key not in self.running:
                    delay, content = 0.0, reply(False, "no job")
                else:
                    ends, content = self.running[key]
                    wait = float(config(m).get("timeout", math.inf))
                    if ends <= now + wait:
                        delay = max(0.0, ends - now)
                        del self.running[key]
                    else:
                        delay, content = wait, reply(pending=1)
            else:
                delay, content = self.nodes[node](m)
            if content is not None:
                self._replies[m.metadata.message_id] = (time.monotonic() + delay, Message(content, reply_to=m))
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        now, out = time.monotonic(), []
        for mid in message_ids:
            if mid in self._replies and self._replies[mid][0] <= now:
                out.append(self._replies.pop(mid)[1])
        return out

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("the strategy must not use Grid.send_and_receive (it may wait forever)")

    def sent(self, message_type: str) -> list[Message]:
        return [m for m in self.pushed if m.metadata.message_type == message_type]


def reply(ok: bool = True, error: str = "", **values: Any) -> RecordDict:
    metrics = {k: v for k, v in values.items() if not isinstance(v, str)}
    info = {"ok": ok, "error": error, **{k: v for k, v in values.items() if isinstance(v, str)}}
    return RecordDict({P.METRICS: MetricRecord(metrics), P.INFO: ConfigRecord(info)})


def hello_ok(node: int, *, shards: int = 2, fingerprint: str = "fp", partition: int = 0) -> RecordDict:
    return reply(method="fl-fsdp", replicas=1, shards=shards, world=shards, rendezvous_host=f"host{node}",
                 rendezvous_ports=[100 * node + s for s in range(shards)], fingerprint=fingerprint,
                 partition_id=partition, tokens=0, compatible=1)


def train_ok(loss: float = 2.0, tokens: int = 100, syncs: int = 2, checksums: list[float] | None = None,
             **extra: Any) -> RecordDict:
    values = dict(losses=[loss, loss], tokens=tokens, total_tokens=tokens, train_s=0.5, sync_s=0.1, eval_s=0.05,
                  syncs=syncs, sync_failed=0, checksums=[1.0, 2.0, 3.0, 4.0] if checksums is None else checksums,
                  eval_loss=1.5)
    return reply(**{**values, **extra})


def group(node: int, partition: int, *, train: Callable[[Message, int], Any] | None = None,
          hello: Callable[[Message], Any] | None = None) -> Behaviour:
    """A well-behaved group unless `train`/`hello` override (they return (delay, content))."""
    count = {"train": 0}

    def behave(m: Message):
        kind = m.metadata.message_type
        if kind == P.MSG_HELLO:
            return hello(m) if hello else (0.0, hello_ok(node, partition=partition))
        if kind == P.MSG_TRAIN:
            count["train"] += 1
            return train(m, count["train"]) if train else (0.0, train_ok())
        if kind == P.MSG_FINISH:
            return 0.0, reply(stopped=1)
        return 0.0, reply()
    return behave


FLAT = {"rounds": "num-server-rounds"}


def spec(**kw: Any) -> FlowerRun:
    """A run with these options (field names of the schema), set without checks: `start` validates."""
    from flwr_sharded import schema

    run, options = FlowerRun(), schema.by_name(FlowerRun)
    for key, value in {"rounds": 3, "syncs_per_round": 2, "aggregate_every": 1, **kw}.items():
        schema.put(run, options[FLAT.get(key, key.replace("_", "-"))].path, value)
    return run


def fast(**kw: Any) -> dict[str, Any]:
    return {"num_groups": 2, "sample_timeout": 1.0, "hello_timeout": 2.0, "round_timeout": 3.0,
            "rendezvous_timeout": 0.5, "sync_timeout": 0.5, "finish_timeout": 1.0, **kw}


def make(run: FlowerRun, deadlines: dict[str, Any], cls: type = DecentralizedFedAvg, *,
         evaluate_in_train: bool = True, **kw: Any) -> DecentralizedFedAvg:
    """The strategy `cls` over `run` with these deadlines, polling the fake grid fast."""
    for key, value in deadlines.items():
        setattr(run.deadlines, key, value)
    run.federation.evaluate_in_train = evaluate_in_train
    return cls(run, polling=Polling(interval=0.01, node_check=0.1), **kw)


def config(m: Message) -> dict:
    return dict(m.content.config_records[P.CONFIG])


@pytest.mark.dist
def test_sampling_gives_up_at_its_deadline(caplog):
    grid = FakeGrid({1: group(1, 0)})
    strategy = make(spec(), fast(num_groups=2, min_groups=2, sample_timeout=2.0))
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="flwr"), pytest.raises(RuntimeError, match="only 1 node"):
        strategy.start(grid)
    assert time.monotonic() - start < 4
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for nodes")]
    assert waiting == ["waiting for nodes: 1 of num-groups 2 connected; in 1 s (sample-timeout) the run goes on with "
                       "those connected, if at least min-groups 2 (a simulation has as many nodes as SuperNodes: "
                       "--federation-config num-supernodes=N)"]
    # with min-groups 1 it goes on with the one node
    result = make(spec(), fast(num_groups=2, min_groups=1, sample_timeout=0.3)).start(FakeGrid(
        {1: group(1, 0)}))
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]


def test_bad_run_config_is_logged_before_anything_is_sent(caplog):
    grid = FakeGrid({1: group(1, 0), 2: group(2, 1)})
    with caplog.at_level(logging.ERROR, logger="flwr"), pytest.raises(ConfigError):
        make(spec(aggregate_every=0), fast()).start(grid)
    assert "'aggregate-every' must be an integer >= 1" in caplog.text
    assert grid.pushed == []


def test_hello_leaves_out_groups_that_do_not_fit(caplog):
    nodes = {
        1: group(1, 0),
        2: group(2, 1, hello=lambda m: (0.0, hello_ok(2, shards=4, partition=1))),
        3: group(3, 2, hello=lambda m: (0.0, reply(False, "data directory /x does not exist"))),
        4: group(4, 3, hello=lambda m: (0.0, None)),  # never answers
        5: group(5, 4, hello=lambda m: (0.0, hello_ok(5, fingerprint="other", partition=4))),
        6: group(6, 5),
    }
    grid = FakeGrid(nodes)
    strategy = make(spec(rounds=1), fast(num_groups=6))
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid)
    assert strategy.membership.members == [1, 6]
    assert "S=4 = 4 ranks" in strategy.membership.left_out[2] and "S=2 = 2 ranks" in strategy.membership.left_out[2]
    assert "does not exist" in strategy.membership.left_out[3]
    assert "no reply" in strategy.membership.left_out[4]
    assert "fingerprint" in strategy.membership.left_out[5]
    assert "group on node 2 left out" in caplog.text
    trains = grid.sent(P.MSG_TRAIN)
    assert sorted(m.metadata.dst_node_id for m in trains) == [1, 6]
    # finish goes to every sampled node, left out or not
    assert sorted(m.metadata.dst_node_id for m in grid.sent(P.MSG_FINISH)) == [1, 2, 3, 4, 5, 6]


def test_no_group_fits_is_an_error_before_any_training(caplog):
    grid = FakeGrid({n: group(n, n - 1, hello=lambda m, n=n: (0.0, hello_ok(n, shards=4, partition=n - 1)))
                     for n in (1, 2)})
    with caplog.at_level(logging.ERROR, logger="flwr"), pytest.raises(ConfigError, match="passed the hello") as exc:
        make(spec(), fast()).start(grid)
    assert grid.sent(P.MSG_TRAIN) == []
    assert "relaunch the group or change the run config" in caplog.text
    assert str(exc.value).count("relaunch the group") == 1 and ": nodes 1, 2: " in str(exc.value)  # said once


def test_config_only_messages_and_round_layout():
    grid = FakeGrid({7: group(7, 1), 3: group(3, 0)})
    strategy = make(spec(rounds=1, syncs_per_round=3, aggregate_every=5), fast())
    strategy.start(grid)
    assert all(len(m.content.array_records) == 0 for m in grid.pushed)
    trains = sorted(grid.sent(P.MSG_TRAIN), key=lambda m: config(m)["member-index"])
    assert [m.metadata.dst_node_id for m in trains] == [3, 7]  # ordered by partition id
    c = config(trains[0])
    assert c["members"] == ["3", "7"] and "syncs-per-round" not in c and "aggregate-every" not in c  # A, K: once
    run = FlowerRun.from_json(config(grid.sent(P.MSG_HELLO)[0])["run"])
    assert (run.federation.syncs_per_round, run.train.parallel.aggregate_every) == (3, 5)
    collects = grid.sent(P.MSG_COLLECT)
    assert sorted((m.metadata.dst_node_id, config(m)["job"]) for m in collects) == sorted(
        (m.metadata.dst_node_id, config(m)["job"]) for m in trains)
    assert c["rendezvous-host"] == "host3" and c["rendezvous-ports"] == [300, 301]  # member 0's offer
    assert config(trains[1])["prefix"] == c["prefix"]
    assert all(m.metadata.ttl <= strategy.deadlines.round_timeout for m in trains)


def test_members_at_facilities_of_equal_size_are_told_their_sites_and_any_other_round_runs_the_flat_ring(caplog):
    """facilities a,a,b,b: the train messages carry every member's site (a two-level round); a, a, b (three groups)
    or one group per facility: none, and the log says why."""
    for facilities, groups, sites, why in [("a,a,b,b", 4, ["a", "a", "b", "b"], None),
                                           ("a,a,b", 3, [], "different numbers of members"),
                                           ("a,b", 2, [], "one member per facility")]:
        caplog.clear()
        grid = FakeGrid({10 + i: group(10 + i, i) for i in range(groups)})
        strategy = make(spec(rounds=1, facilities=facilities), fast(num_groups=groups))
        with caplog.at_level(logging.INFO):
            strategy.start(grid)
        trains = sorted(grid.sent(P.MSG_TRAIN), key=lambda m: config(m)["member-index"])
        assert [config(m).get("member-sites", []) for m in trains] == [sites] * groups, facilities
        assert why is None or any("the flat ring" in r.message and why in r.message for r in caplog.records)


def test_failed_sync_survivors_roll_back_and_membership_reforms(caplog):
    def dies_in_round_2(m, n):
        return (0.0, reply(False, "lost the connection to the group (did the group die?)")) if n >= 2 \
            else (0.0, train_ok())

    def rolls_back_in_round_2(m, n):
        if n == 2:
            return 0.0, train_ok(syncs=0, checksums=[], sync_failed=1,
                                 sync_error="shard 0: RendezvousError: member(s) [2] did not arrive")
        return 0.0, train_ok()

    grid = FakeGrid({1: group(1, 0, train=rolls_back_in_round_2), 2: group(2, 1, train=rolls_back_in_round_2),
                     3: group(3, 2, train=dies_in_round_2)})
    strategy = make(spec(rounds=3), fast(num_groups=3), rejoin=False)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = strategy.start(grid)
    rounds = [h for h in strategy.history if h["kind"] == "round"]
    assert [r["synced"] for r in rounds] == [1, 0, 1]
    assert (rounds[1]["rolled_back"], rounds[1]["dropped"]) == (2, 1)
    assert rounds[2]["members"] == ["1", "2"] and rounds[2]["groups"] == 2
    round3 = [m for m in grid.sent(P.MSG_TRAIN) if config(m)["prefix"].endswith("round3")]
    assert sorted(m.metadata.dst_node_id for m in round3) == [1, 2]
    assert all(config(m)["members"] == ["1", "2"] for m in round3)
    assert "restored their last synced shards" in caplog.text
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]


def test_survivors_are_told_at_once_when_a_member_is_gone_and_every_round_has_its_own_secret():
    """Round 1: node 3's group dies (its collect fails at once) while nodes 1 and 2 wait at the rendezvous, which
    would take them 20 s. Their collects wait 0.3 s each (collect-interval) and come back pending; the ServerApp
    tells both at once that member index 2 is gone (an abort naming the round), they give up and reply sync_failed,
    and the round ends within seconds instead of at the rendezvous timeout."""
    told: dict[int, float] = {}

    class Grid(FakeGrid):
        def push_messages(self, messages):
            for m in messages:  # an abort ends the survivor's wait at the rendezvous: it replies sync_failed now
                if m.metadata.message_type == P.MSG_ABORT:
                    node = m.metadata.dst_node_id
                    told.setdefault(node, time.monotonic())
                    for key in [k for k in self.running if k[0] == node]:
                        self.running[key] = (time.monotonic(), train_ok(syncs=0, sync_failed=1, sync_error="gone"))
            return super().push_messages(messages)

    def waits(m, n):
        return (20.0, train_ok(syncs=0, sync_failed=1, sync_error="did not arrive")) if n == 1 else (0.0, train_ok())

    def dies(m, n):
        return (0.0, reply(False, "lost the connection to the group (did the group die?)"))

    grid = Grid({1: group(1, 0, train=waits), 2: group(2, 1, train=waits), 3: group(3, 2, train=dies)})
    strategy = make(spec(rounds=2), fast(num_groups=3, round_timeout=60.0, rendezvous_timeout=20.0,
                                         collect_interval=0.3), rejoin=False)
    start = time.monotonic()
    strategy.start(grid)
    assert time.monotonic() - start < 10, "the survivors waited out their rendezvous"
    aborts = grid.sent(P.MSG_ABORT)
    assert sorted(m.metadata.dst_node_id for m in aborts) == [1, 2]
    assert all(config(m)["gone"] == [2] and config(m)["prefix"].endswith("round1") for m in aborts)
    assert "lost the connection" in config(aborts[0])["reason"]
    assert max(told.values()) - start < 5
    round1 = [m for m in grid.sent(P.MSG_COLLECT) if config(m)["job"].endswith(("round1/1", "round1/2"))]
    assert len(round1) >= 4 and all(config(m)["timeout"] <= 1.0 for m in round1)  # bounded, then sent again
    rounds = [h for h in strategy.history if h["kind"] == "round"]
    assert (rounds[0]["rolled_back"], rounds[0]["dropped"]) == (2, 1) and rounds[1]["members"] == ["1", "2"]
    secrets = [{config(m)["secret"] for m in grid.sent(P.MSG_TRAIN) if config(m)["server-round"] == r}
               for r in (1, 2)]
    assert [len(s) for s in secrets] == [1, 1] and secrets[0] != secrets[1]  # one per round, shared by its members
    assert all(len(next(iter(s))) >= 32 for s in secrets)


def test_a_lost_node_does_not_hang_the_round():
    grid = FakeGrid({1: group(1, 0), 2: group(2, 1, train=lambda m, n: (0.0, None))})
    strategy = make(spec(rounds=2), fast(round_timeout=30.0))
    grid.offline_at[2] = time.monotonic() + 1.0  # its SuperNode is killed: it drops off the online list
    start = time.monotonic()
    strategy.start(grid)
    assert time.monotonic() - start < 10, "waited for a node that went offline"
    rounds = [h for h in strategy.history if h["kind"] == "round"]
    assert rounds[0]["dropped"] == 1 and rounds[1]["members"] == ["1"]


def test_a_silent_node_is_dropped_at_the_round_deadline():
    grid = FakeGrid({1: group(1, 0), 2: group(2, 1, train=lambda m, n: (0.0, None))})
    strategy = make(spec(rounds=2), fast(round_timeout=1.0))
    start = time.monotonic()
    strategy.start(grid)
    assert time.monotonic() - start < 8
    assert "no reply before the deadline" in strategy.membership.left_out[2]


def test_flower_error_replies_drop_the_node():
    grid = FakeGrid({1: group(1, 0), 2: group(2, 1, train=lambda m, n: (0.0, Error(code=5, reason="node gone")))})
    strategy = make(spec(rounds=2), fast())
    strategy.start(grid)
    assert "node gone" in strategy.membership.left_out[2]
    assert strategy.membership.members == [1]


def test_metrics_are_token_weighted_and_overhead_is_reported():
    grid = FakeGrid({1: group(1, 0, train=lambda m, n: (1.0, train_ok(loss=1.0, tokens=300))),
                     2: group(2, 1, train=lambda m, n: (0.0, train_ok(loss=3.0, tokens=100,
                                                                       checksums=[9.0, 2.0, 3.0, 4.0])))})
    strategy = make(spec(rounds=1), fast())
    result = strategy.start(grid)
    record = strategy.history[0]
    assert record["train_loss"] == pytest.approx(1.5)  # (1*300 + 3*100) / 400
    assert record["tokens"] == 400 and record["eval_ppl"] == pytest.approx(math.exp(1.5))
    assert record["round_s"] >= 1.0 and record["overhead_s"] == pytest.approx(record["round_s"] - 0.65, abs=1e-6)
    assert record["checksums_equal"] == 0
    assert result.train_metrics_clientapp[1]["train_loss"] == pytest.approx(1.5)
    assert result.evaluate_metrics_clientapp[1]["eval_loss"] == pytest.approx(1.5)
    summary = strategy.history[-1]
    assert summary["kind"] == "summary" and summary["rounds"] == 1


def test_separate_evaluate_messages():
    def evaluate_reply(node):
        def behave(m: Message):
            if m.metadata.message_type == P.MSG_EVALUATE:
                return 0.0, reply(eval_loss=2.0 if node == 1 else 4.0, eval_s=0.1)
            return group(node, node - 1)(m)
        return behave

    grid = FakeGrid({1: evaluate_reply(1), 2: evaluate_reply(2)})
    strategy = make(spec(rounds=2), fast(), evaluate_in_train=False)
    result = strategy.start(grid)
    assert all(not config(m)["evaluate"] for m in grid.sent(P.MSG_TRAIN))
    assert len(grid.sent(P.MSG_EVALUATE)) == 4
    assert result.evaluate_metrics_clientapp[2]["eval_loss"] == pytest.approx(3.0)
    assert strategy.history[1]["eval_ppl"] == pytest.approx(math.exp(3.0))


def test_a_dropped_group_that_answers_hello_again_rejoins_last_with_a_catch_up(caplog):
    def fails_in_round_2(m, n):
        return (0.0, reply(False, "lost the connection to the group")) if n == 2 else (0.0, train_ok())

    grid = FakeGrid({1: group(1, 0), 2: group(2, 1, train=fails_in_round_2), 3: group(3, 2)})
    strategy = make(spec(rounds=4), fast(num_groups=3))
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid)
    rounds = [h for h in strategy.history if h["kind"] == "round"]
    assert [r["dropped"] for r in rounds] == [0, 1, 0, 0]
    assert [r["rejoined"] for r in rounds] == [[], [], ["2"], []]
    assert rounds[2]["members"] == ["1", "3", "2"]  # after the established members: member 0 is the source
    catch_up = {config(m)["prefix"].rsplit("/", 1)[1]: config(m)["catch-up"] for m in grid.sent(P.MSG_TRAIN)}
    assert catch_up == {"round1": False, "round2": False, "round3": True, "round4": False}
    hellos = [m for m in grid.sent(P.MSG_HELLO) if m.metadata.dst_node_id == 2]
    assert len(hellos) == 2 and config(hellos[1])["rejoin"] and config(hellos[1])["partition-id"] == 1
    assert "rejoin; the round starts with a catch-up" in caplog.text


def test_a_failed_checkpoint_write_is_logged_and_recorded_and_the_group_stays(caplog):
    full = "checkpoint step-00000004 not written (No space left on device); the previous one step-00000002 is kept"
    first_fails = {1: {"checkpoint_error": full}}
    grid = FakeGrid({1: group(1, 0, train=lambda m, n: (0.0, train_ok(**first_fails.get(n, {})))), 2: group(2, 1)})
    strategy = make(spec(rounds=2), fast())
    with caplog.at_level(logging.ERROR):
        strategy.start(grid)
    first, second = strategy.history[0], strategy.history[1]
    assert first["checkpoint_errors"] == {"1": full} and "checkpoint_errors" not in second
    assert first["groups"] == second["groups"] == 2  # the group trains on
    assert "round 1: group on node 1 could not write its checkpoint, it trains on" in caplog.text


def test_a_persistent_straggler_sits_out_after_max_strikes_then_rejoins_with_a_catch_up(caplog):
    """Node 3 (member index 2) reaches the rendezvous late in every round it is in, until round 5: nodes 1 and 2
    give up on it and name it (sync_blame); it names them back, a lone report that strikes nobody. After
    max-strikes = 2 such rounds it sits out bench-rounds = 2 rounds, which sync; it then rejoins with a catch-up."""
    def honest(m, n):
        if len(config(m)["members"]) == 3 and config(m)["server-round"] <= 2:
            return 0.0, train_ok(syncs=0, checksums=[], sync_failed=1, sync_blame=[2],
                                 sync_error="shard 0: member(s) [2] did not arrive within 0 s")
        return 0.0, train_ok()

    def straggler(m, n):
        if n <= 2:
            return 0.0, train_ok(syncs=0, checksums=[], sync_failed=1, sync_blame=[0, 1], sync_error="late")
        return 0.0, train_ok()

    grid = FakeGrid({1: group(1, 0, train=honest), 2: group(2, 1, train=honest), 3: group(3, 2, train=straggler)})
    strategy = make(spec(rounds=6, max_strikes=2, bench_rounds=2), fast(num_groups=3))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid)
    rounds = [h for h in strategy.history if h["kind"] == "round"]
    assert [r["members"] for r in rounds] == [["1", "2", "3"]] * 2 + [["1", "2"]] * 2 + [["1", "2", "3"]] * 2
    assert [r["synced"] for r in rounds] == [0, 0, 1, 1, 1, 1]
    assert [sorted(r["at_fault"]) for r in rounds] == [["3"], ["3"], [], [], [], []]
    assert [r["rejoined"] for r in rounds][4] == ["3"]
    catch_up = {config(m)["server-round"]: config(m)["catch-up"] for m in grid.sent(P.MSG_TRAIN)}
    assert catch_up == {1: False, 2: False, 3: False, 4: False, 5: True, 6: False}
    assert "group on node 3 left out after round 2 for 2 round(s)" in caplog.text
    assert "it may rejoin in round 5" in caplog.text


def test_a_round_that_leaves_groups_diverged_is_repaired_by_a_catch_up(caplog):
    """Node 2's sync fails after node 1 adopted it (its commit vote was lost): the next round starts with a
    catch-up from member 0, so both train on from the same shards."""
    def fails_once(m, n):
        return (0.0, train_ok(syncs=1, sync_failed=1, sync_error="commit vote: peer gone")) if n == 1 \
            else (0.0, train_ok())

    grid = FakeGrid({1: group(1, 0), 2: group(2, 1, train=fails_once)})
    strategy = make(spec(rounds=3), fast())
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid)
    catch_up = {config(m)["server-round"]: config(m)["catch-up"] for m in grid.sent(P.MSG_TRAIN)}
    assert catch_up == {1: False, 2: True, 3: False}
    assert "round 2 starts with a catch-up from member 0: round 1 left the groups with different shards" in caplog.text
