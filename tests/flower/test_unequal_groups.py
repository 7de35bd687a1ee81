"""Groups that shard differently in one decentralised round: the strategy's checks and records (no processes), and
two groups of 1 and 2 ranks driven directly against the static engine's `--group-shards 1,2`, then a group relaunched
with another S catching up from a member of another layout."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from flwr_sharded.flower import messages as P
from flwr_sharded.flower.group import channels
from flwr_sharded.flower.group.contract import InstructionError
from flwr_sharded.flower.group.round_context import RoundContext
from flwr_sharded.flower.run_config import FlowerRun
from flwr_sharded.flower.server import records
from flwr_sharded.flower.server.membership import check_layouts, empty_shards, rejoin_refusal, seat_refusal
from flwr_sharded.flower.server.strategy import member_shards
from flwr_sharded.parallel.sync_plan import SyncPlan
from tests.flower.procs import group_pids, start_group, start_groups, wait_until
from tests.flower.test_strategy import task_identity  # noqa: F401  (a fixture: Flower messages outside a run)
from tests.flower.test_group import all_gone, client, hello, round_args, spec
from tests.multiproc import train_ranks


def group(shards: int, rows: list[int], replicas: int = 1, digest: str = "d", fingerprint: str = "") -> SimpleNamespace:
    layout = P.GroupLayout("fl-fsdp", replicas, shards, replicas * shards)
    return SimpleNamespace(layout=layout, param_rows=rows, model_digest=digest, fingerprint=fingerprint or f"f{shards}")


def test_members_that_shard_differently_get_their_s_and_a_plan_every_shard_can_sit_in():
    groups = {7: group(1, [16, 3]), 9: group(2, [16, 3]), 11: group(2, [16, 3])}
    assert member_shards(groups, [7, 9]) == [1, 2]
    assert member_shards(groups, [9, 11]) == []  # alike: the plain path
    assert empty_shards([3, 2], 4) == [3] and empty_shards([16, 3], 4) == []
    refused = seat_refusal(group(4, [3, 2]), {1, 4})
    assert "S=4 leaves shard(s) [3] without a row" in refused and "S=[1, 4]" in refused
    membership = SimpleNamespace(run=SimpleNamespace(federation=SimpleNamespace(aggregation="decentralized")),
                                 groups=groups, members=[7, 9])
    assert rejoin_refusal(membership, group(3, [16, 3]), groups[7]) == ""
    assert "differs from the members'" in rejoin_refusal(membership, group(3, [16, 3], digest="x"), groups[7])
    assert "fingerprint" in rejoin_refusal(membership, group(1, [16, 3], fingerprint="other"), groups[7])


def test_a_group_runs_its_own_s_on_the_decentralised_path_unless_the_partition_is_iid():
    run = FlowerRun.from_run_config({"shards": 2, "partition": "iid-groups"})
    assert run.takes_own_shards and run.for_group(0, own_shards=3).train.parallel.shards == 3
    iid = FlowerRun.from_run_config({"shards": 2})  # blocks of groups of different sizes would overlap
    assert iid.for_group(0, own_shards=3).train.parallel.shards == 2
    assert "partition iid-groups or document" in P.GroupLayout("fl-fsdp", 1, 3, 3).mismatch(iid)
    server = FlowerRun.from_run_config({"shards": 2, "partition": "iid-groups", "aggregation": "server"})
    assert server.for_group(0, own_shards=3).train.parallel.shards == 2  # the facility gives S


def test_a_group_of_another_model_and_one_no_plan_can_serve_are_left_out_by_name():
    kept: dict[int, str] = {}

    def keep_majority(candidates, key, reason):  # GroupMembership._keep_majority's contract
        from collections import Counter
        common = Counter(key(g) for g in candidates.values()).most_common(1)[0][0]
        for node, g in list(candidates.items()):
            if key(g) != common:
                kept[node] = reason(g, common)
                del candidates[node]

    membership = SimpleNamespace(run=SimpleNamespace(federation=SimpleNamespace(aggregation="decentralized")),
                                 left_out={}, _keep_majority=keep_majority)
    candidates = {1: group(1, [3, 2]), 2: group(2, [3, 2]), 3: group(2, [3, 2], digest="other"),
                  4: group(4, [3, 2])}
    check_layouts(membership, candidates)
    assert sorted(candidates) == [1, 2]
    assert "its model" in kept[3] and "another model" in kept[3]
    assert "S=4 leaves shard(s) [3]" in membership.left_out[4]


def test_the_round_names_its_channels_and_the_records_compare_groups_of_one_layout():
    args = P.TrainArgs(server_round=1, job="j", members=["a", "b"], member_index=1, rendezvous_host="h",
                       rendezvous_ports=[1], prefix="run/round1", rendezvous_timeout=1, sync_timeout=1,
                       secret="s" * 32, member_shards=[1, 2])
    shapes = ((16, 4), (3,))
    ctx = RoundContext.of(args, FlowerRun(), shapes, replicas=1, shards=2, shard=1)
    assert ctx.plan == SyncPlan((1, 2), shapes) and ctx.seat.shard == 1
    assert ctx.scopes == ("run/round1/c0-0", "run/round1/c0-1")
    assert P.TrainArgs.from_config(args.to_config()).member_shards == [1, 2]
    args.member_shards, args.rendezvous_ports = [], [1, 2]
    ctx = RoundContext.of(args, FlowerRun(), shapes, replicas=1, shards=2, shard=1)
    assert "member-shards" not in args.to_config() and ctx.plan is None and ctx.seat is None
    assert ctx.scopes == ("run/round1/s0", "run/round1/s1")
    sums = {"1": [1.0], "2": [0.5, 0.5], "3": [0.5, 0.5]}
    assert all(records.checksums_equal(same, 1, world)
               for world, same in records.by_layout(sums, {"1": "1x1", "2": "1x2", "3": "1x2"}, 1))
    record = records.round_record(1, [1, 2], {1: {"checksums": [1.0], "syncs": 1},
                                              2: {"checksums": [0.5, 0.5], "syncs": 1}}, {}, {}, 1.0, 1, [],
                                  layouts={"1": "1x1", "2": "1x2"})
    assert record["checksums_equal"] == 1 and record["layouts"] == {"1": "1x1", "2": "1x2"}


class _RefusingLoop:
    """A sync loop whose seat no plan can serve (as `ShardSync.reseat` refuses a shard without rows)."""

    def __init__(self) -> None:
        import torch

        self.trainer, self.plans = SimpleNamespace(model=torch.nn.Linear(4, 1)), []

    def configure(self, plan) -> None:
        self.plans.append(plan)
        if plan.seat is not None:
            raise ValueError("shard 1 of group 1 (S=2) holds no row of any parameter")


def test_a_group_no_plan_can_serve_refuses_the_round_on_every_rank_before_training():
    loop = _RefusingLoop()
    runtime = SimpleNamespace(loop=loop, gather=lambda x: [x, ""])
    args = P.TrainArgs(server_round=1, job="j", members=["a", "b"], member_index=1, rendezvous_host="h",
                       rendezvous_ports=[1], prefix="p", rendezvous_timeout=1, sync_timeout=1, secret="s" * 32,
                       member_shards=[1, 2])
    shapes = channels.model_shapes(loop.trainer.model)
    ctx = RoundContext.of(args, FlowerRun(), shapes, replicas=1, shards=2, shard=1)
    with pytest.raises(InstructionError, match=r"R=1 x S=2\) cannot sync with members of S=\[1, 2\]: shard 1"):
        channels.prepare(runtime, ctx)
    assert loop.plans[-1].seat is None  # back to whole shards, the same on every rank
    assert loop.plans[-1].weight_world == 1 * 2  # weights bounded by this group's own world again
    args.member_shards = [1, 1]
    with pytest.raises(InstructionError, match="gives member 1 S=1, but this group runs S=2"):
        RoundContext.of(args, FlowerRun(), shapes, replicas=1, shards=2, shard=1)


def _train_round(clients, offer, prefix: str, shards: list[int], **flags) -> list[dict]:
    jobs = [c.call(P.TRAIN, round_args(offer, prefix, i, len(clients), member_shards=shards, **flags), timeout=30,
                   detach=True)["job"] for i, c in enumerate(clients)]
    out = [c.collect(job, timeout=240) for c, job in zip(clients, jobs)]
    for o in out:
        assert o is not None and not o["sync_failed"], out
    return out


def _static_unequal(data_dir: Path, tmp: Path, run, layouts: str) -> tuple[list[float], list[float]]:
    t, p, k = run.train, run.train.parallel, run.federation.syncs_per_round
    result = train_ranks(p.replicas * sum(int(s) for s in layouts.split(",")), [
        "--method", p.method, "--replicas", str(p.replicas), "--group-shards", layouts, "--model", t.model.name,
        "--data-dir", str(data_dir),
        "--seq-len", str(t.data.seq_len), "--batch-size", str(t.batch_size), "--eval-blocks", str(t.data.eval_blocks),
        "--steps", str(run.total_steps), "--aggregate-every", str(p.aggregate_every), "--lr", str(t.optim.lr),
        "--warmup", str(t.optim.warmup), "--min-lr-ratio", str(t.optim.min_lr_ratio), "--weight-decay",
        str(t.optim.weight_decay), "--grad-clip", str(t.optim.grad_clip), "--seed", str(t.seed), "--partition",
        t.data.partition, "--log-every", "1",
        "--eval-every", str(k * p.aggregate_every), "--run-dir", str(tmp / "static"), "--no-save-model",
        "--no-progress"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp / "static" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["kind"] == "train"], [r["eval_loss"] for r in lines if r["kind"] == "eval"]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_groups_of_one_and_two_ranks_match_the_static_engine_and_a_relaunched_group_of_another_s_catches_up(
        procs, data_dir, tmp_path):
    """Groups of S = 1 and 2 (fl-fsdp), 2 rounds of K = 2 syncs x A = 3 steps, against `flwr_sharded.train
    --group-shards 1,2` (same seed and samples: partition iid-groups): every step's loss (the mean over the 3 ranks)
    and the held-out loss after each round agree within 1e-5, and the two groups end each round with the same model
    (their shards' sums agree). Then the S = 2 group is killed, the other trains a round alone, and the group comes
    back with S = 3: the round's catch-up gives it member 0's model, step and learning rate before it trains."""
    s = spec(data_dir, shards=2, partition="iid-groups")  # each group runs its own S (`takes_own_shards`)
    (_, a_addr, a_key), (_, b_addr, b_key) = start_groups(procs, [("a", dict(shards=1)), ("b", dict(shards=2))])
    a, b = client(a_addr, a_key), client(b_addr, b_key)
    hellos = [hello(a, s, 0, 2), hello(b, s, 1, 2)]
    assert hellos[0]["model_digest"] == hellos[1]["model_digest"]
    assert hellos[0]["fingerprint"] != hellos[1]["fingerprint"]  # their shards differ
    assert hellos[0]["param_rows"] == hellos[1]["param_rows"]
    losses, evals = [], []
    for r in range(s.federation.rounds):
        out = _train_round([a, b], hellos[0], f"unequal/round{r}", [1, 2])
        assert [o["syncs"] for o in out] == [s.federation.syncs_per_round] * 2
        assert sum(out[0]["checksums"][-1:]) == pytest.approx(sum(out[1]["checksums"][-2:]), rel=1e-9, abs=1e-9)
        losses += [(x + 2 * y) / 3 for x, y in zip(out[0]["losses"], out[1]["losses"])]
        assert out[0]["eval_loss"] == pytest.approx(out[1]["eval_loss"], abs=1e-6)
        evals.append((out[0]["eval_loss"] + out[1]["eval_loss"]) / 2)
    static_losses, static_evals = _static_unequal(data_dir, tmp_path, s, "1,2")
    assert losses == pytest.approx(static_losses, abs=1e-5)
    assert evals == pytest.approx(static_evals, abs=1e-5)
    assert losses[-1] < losses[0] - 0.3  # it trained

    pids = group_pids(b_addr, b_key)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: all_gone(pids), 60, what="group b gone")
    (alone,) = _train_round([a], hellos[0], "unequal/alone", [], syncs=1, steps=2)
    _, c_addr, c_key = start_group(procs, "c", shards=3)
    c = client(c_addr, c_key)
    assert hello(c, s, 1, 2)["steps"] == 0  # a fresh group, of another S
    got_a, got_c = _train_round([a, c], hellos[0], "unequal/rejoin", [1, 3], syncs=1, steps=2, catch_up=True,
                                evaluate=False)
    assert got_a["catch_up_checksums"] == alone["checksums"]
    assert sum(got_c["catch_up_checksums"]) == pytest.approx(sum(alone["checksums"]), rel=1e-9, abs=1e-9)
    assert got_c["step"] == got_a["step"] == alone["step"] + 2 and got_c["lr"] == got_a["lr"]
    assert sum(got_c["checksums"]) == pytest.approx(sum(got_a["checksums"]), rel=1e-9, abs=1e-9)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_fl_hsdp_groups_of_different_s_match_the_static_engine_replicas_alike(procs, data_dir, tmp_path):
    """R = 2 groups of S = 1 and 2 (6 ranks), one round of K = 2 syncs x A = 3 steps: the replicas, which take each
    bucket of their seat from replica 0, end every sync equal, both groups hold one model, and every step's loss
    equals `--method fl-hsdp --replicas 2 --group-shards 1,2` (1e-5)."""
    s = spec(data_dir, method="fl-hsdp", replicas=2, shards=2, partition="iid-groups", rounds=1)
    layout = dict(method="fl-hsdp", replicas=2)
    (_, a_addr, a_key), (_, b_addr, b_key) = start_groups(procs, [("a", dict(shards=1, **layout)),
                                                                  ("b", dict(shards=2, **layout))])
    a, b = client(a_addr, a_key), client(b_addr, b_key)
    offer, _ = hello(a, s, 0, 2), hello(b, s, 1, 2)
    out = _train_round([a, b], offer, "hsdp/round0", [1, 2])
    for k in range(s.federation.syncs_per_round):
        one, two = out[0]["checksums"][k * 2:(k + 1) * 2], out[1]["checksums"][k * 4:(k + 1) * 4]
        assert one[0] == one[1] and two[:2] == two[2:]  # replica 1 = replica 0, shard by shard
        assert one[0] == pytest.approx(sum(two[:2]), rel=1e-9)
    losses = [(2 * x + 4 * y) / 6 for x, y in zip(out[0]["losses"], out[1]["losses"])]
    static_losses, _ = _static_unequal(data_dir, tmp_path, s, "1,2")
    assert losses == pytest.approx(static_losses, abs=1e-5)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_a_flower_simulation_of_groups_of_two_and_one_ranks_matches_the_static_engine(data_dir, tmp_path):
    """`flwr run` in simulation, partition 0 with S = 2 and partition 1 with S = 1 (`facility-shards`): the
    ServerApp sends every member's S, the groups sync over their plan's channels, every step's loss (token-weighted:
    the mean over the 3 ranks) and each round's held-out loss agree with `flwr_sharded.train --group-shards 2,1`
    within 1e-5, and the records and the summary name each group's layout."""
    from tests.flower.conftest import run_demo
    from tests.flower.procs import FAST_RUN_CONFIG

    c = {**FAST_RUN_CONFIG, "shards": 2, "facilities": "a,b", "facility-shards": "b=1", "partition": "iid-groups"}
    run = run_demo(tmp_path, data_dir, c, timeout=600)
    assert run.returncode == 0, run.output[-5000:]
    assert len(run.rounds) == c["num-server-rounds"]
    for record in run.rounds:
        assert (record["groups"], record["synced"], record["syncs"]) == (2, 1, c["syncs-per-round"])
        assert sorted(record["layouts"].values()) == ["1x1", "1x2"] and record["checksums_equal"] == 1
    (summary,) = run.summary
    assert sorted(summary["layouts"].values()) == ["1x1", "1x2"] and "groups (R x S): node" in run.output
    static_losses, static_evals = _static_unequal(data_dir, tmp_path, FlowerRun.from_run_config(c), "2,1")
    assert [x for r in run.rounds for x in r["losses"]] == pytest.approx(static_losses, abs=1e-5)
    assert [r["eval_loss"] for r in run.rounds] == pytest.approx(static_evals, abs=1e-5)


def test_the_strategy_sends_every_members_s_leaves_another_model_out_and_names_the_layouts(caplog):
    """Fake nodes (no processes): S = 2 and S = 1 with one model, and a third group of another model."""
    import logging

    from tests.flower.test_strategy import FakeGrid, config, fast, group as fake_group, hello_ok, make, spec as run
    from tests.flower.test_strategy import train_ok

    def hello_of(node: int, shards: int, partition: int, digest: str = "model"):
        def answer(m):
            out = hello_ok(node, shards=shards, fingerprint=f"fp{shards}", partition=partition)
            out[P.INFO]["model_digest"] = digest
            out[P.METRICS]["param_rows"] = [16, 3]
            return 0.0, out
        return answer

    def train_of(shards: int):
        return lambda m, n: (0.0, train_ok(checksums=[1.0] * (2 * shards)))

    grid = FakeGrid({1: fake_group(1, 0, hello=hello_of(1, 2, 0), train=train_of(2)),
                     2: fake_group(2, 1, hello=hello_of(2, 1, 1), train=train_of(1)),
                     3: fake_group(3, 2, hello=hello_of(3, 1, 2, digest="other"), train=train_of(1))})
    strategy = make(run(shards=2, partition="iid-groups", rounds=1), fast(num_groups=3, min_groups=2))
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid)
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "group on node 3 left out: its model (parameter names, shapes and dtypes: digest other)" in log
    trains = grid.sent(P.MSG_TRAIN)
    assert [config(m)["member-shards"] for m in trains] == [[2, 1], [2, 1]]
    assert config(trains[0])["members"] == ["1", "2"] and len(config(trains[0])["rendezvous-ports"]) == 2
    (record,) = [h for h in strategy.history if h.get("kind") == "round"]
    assert record["layouts"] == {"1": "1x2", "2": "1x1"} and record["checksums_equal"] == 1
    assert "groups (R x S): node 1: 1x2, node 2: 1x1" in log  # those that passed the hello


def test_a_group_dropped_and_relaunched_with_another_s_rejoins_with_a_catch_up():
    """Fake nodes: both groups run S = 2; node 2 fails round 1, is relaunched with S = 3 and rejoins in round 2 with a
    catch-up from member 0, the members' S sent with it."""
    from tests.flower.test_strategy import FakeGrid, config, fast, group as fake_group, hello_ok, make, reply
    from tests.flower.test_strategy import spec as run
    from tests.flower.test_strategy import train_ok

    hellos = {1: [2], 2: [2, 3]}

    def hello_of(node: int, partition: int):
        def answer(m):
            shards = hellos[node].pop(0) if len(hellos[node]) > 1 else hellos[node][0]
            out = hello_ok(node, shards=shards, fingerprint=f"fp{shards}", partition=partition)
            out[P.INFO]["model_digest"] = "model"
            out[P.METRICS]["param_rows"] = [16, 3]
            return 0.0, out
        return answer

    def node_2(m, n):
        return (0.0, reply(False, "rank 1 died")) if n == 1 else (0.0, train_ok(checksums=[1.0] * 6))

    grid = FakeGrid({1: fake_group(1, 0, hello=hello_of(1, 0)),
                     2: fake_group(2, 1, hello=hello_of(2, 1), train=node_2)})
    strategy = make(run(shards=2, partition="iid-groups", rounds=2), fast(min_groups=1))
    strategy.start(grid)
    trains = grid.sent(P.MSG_TRAIN)
    first, second = trains[:2], trains[2:]
    assert ["member-shards" in config(m) for m in first] == [False, False]  # alike: the plain path
    assert [(config(m)["member-shards"], config(m)["catch-up"]) for m in second] == [([2, 3], True)] * 2
    assert [h.get("layouts") for h in strategy.history if h.get("kind") == "round"] == [None, {"1": "1x2", "2": "1x3"}]
