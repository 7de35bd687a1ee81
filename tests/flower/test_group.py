"""The group runtime driven directly (no Flower): endpoint, lifecycle, shard syncs, parity with the static engine,
failed syncs and rollback. Every group runs in its own session and is killed in a `finally`."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from flwr_sharded.flower import messages as P
from flwr_sharded.flower.endpoint import GroupClient, GroupError, GroupUnavailable, read_authkey, write_authkey
from flwr_sharded.flower.node_policy import NodePolicy
from flwr_sharded.flower.run_config import FlowerRun, RoundOptions
from tests.flower.procs import free_port, group_pids, pid_alive, start_group, start_groups, wait_until
from tests.multiproc import faults_env, run_ranks, train_ranks

pytestmark = pytest.mark.dist  # every test here starts processes


ROUND_SECRET = "0123456789abcdef" * 4
"""The secret of every round these tests run (the ServerApp makes a fresh one per round)."""


def client(address: str, key: Path) -> GroupClient:
    return GroupClient(address, read_authkey(key))


def spec(data_dir: Path, **kw: Any) -> FlowerRun:
    """A small run; keyword names are run-config keys with '_' (rounds: num-server-rounds)."""
    values = dict(model="tiny", method="fl-fsdp", replicas=1, shards=2, aggregate_every=3, syncs_per_round=2,
                  rounds=2, data_dir=str(data_dir), seq_len=32, batch_size=2, eval_blocks=8, lr=3e-3, seed=3)
    values.update(kw)
    flat = {("num-server-rounds" if k == "rounds" else k.replace("_", "-")): v for k, v in values.items()}
    return FlowerRun.from_run_config(flat)


def hello(c: GroupClient, run: FlowerRun, partition: int, partitions: int, **args: Any) -> dict:
    """A hello as a ClientApp that launched its group sends it (its node policy allows rules and directories)."""
    out = c.call(P.HELLO, {"run": run.to_json(), "run_key": "test", "partition_id": partition,
                           "num_partitions": partitions, "policy": NodePolicy.open().to_args(), **args}, timeout=120)
    assert out["compatible"], out["error"]
    return out


def round_args(offer: dict, prefix: str, i: int, members: int, *, syncs: int | None = None,
               steps: int | None = None, rendezvous_timeout: float = 30.0, sync_timeout: float = 30.0,
               **flags: Any) -> dict:
    """The train config member `i` of a round gets (K and A as round overrides when given)."""
    options = RoundOptions(syncs_per_round=syncs, aggregate_every=steps)
    return P.TrainArgs(server_round=1, job=f"{prefix}/{i}", members=[str(m) for m in range(members)],
                       member_index=i, rendezvous_host=offer["rendezvous_host"],
                       rendezvous_ports=offer["rendezvous_ports"], prefix=prefix,
                       rendezvous_timeout=rendezvous_timeout, sync_timeout=sync_timeout,
                       secret=ROUND_SECRET, round=options, **flags).to_config()


def train(c: GroupClient, config: dict, timeout: float = 180.0) -> dict:
    """Start a round (detached, as the ClientApp does) and collect its result."""
    job = c.call(P.TRAIN, config, timeout=30, detach=True)["job"]
    return c.collect(job, timeout=timeout)


def train_all(clients: list[GroupClient], offer: dict, prefix: str, *, syncs: int | None, steps: int | None,
              rendezvous_timeout: float = 30.0, sync_timeout: float = 30.0, members: int | None = None,
              may_fail: tuple[int, ...] = ()) -> list:
    """One round on every client: every round started, then every result collected, as the ServerApp drives it."""
    n = members or len(clients)
    jobs = [c.call(P.TRAIN, round_args(offer, prefix, i, n, syncs=syncs, steps=steps,
                                       rendezvous_timeout=rendezvous_timeout, sync_timeout=sync_timeout),
                   timeout=30, detach=True)["job"] for i, c in enumerate(clients)]
    out: list[Any] = []
    for c, job in zip(clients, jobs):
        try:
            out.append(c.collect(job, timeout=180))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.append(exc)
    for i, o in enumerate(out):
        if (isinstance(o, Exception) or o is None) and i not in may_fail:
            raise AssertionError(f"group {i}: {o!r}")
    return out


def all_gone(pids: list[int]) -> bool:
    return not any(pid_alive(p) for p in pids)


@pytest.mark.timeout(240)
def test_endpoint_authenticates_and_serves_verbs(procs, data_dir, tmp_path):
    proc, address, key = start_group(procs, "g", shards=1)
    pids = [proc.pid, *group_pids(address, key)]
    wrong = tmp_path / "wrong.key"
    write_authkey(wrong)
    with pytest.raises(GroupUnavailable, match="rejected"):
        client(address, wrong).call(P.STATUS, timeout=10)
    c = client(address, key)
    from multiprocessing.connection import Client

    from flwr_sharded.flower.endpoint import parse_address

    for payload in (b'{"version": 2, "verb": "status", "args": ' + b"[" * 50000 + b"]" * 50000 + b"}",
                    b'{"version": 2, "verb": "train", "args": {"lr": NaN}}'):  # rank 0 answers, and survives
        with Client(parse_address(address), authkey=read_authkey(key)) as conn:
            conn.send_bytes(payload)
            assert conn.poll(30) and "bad request" in P.decode(conn.recv_bytes(), allow_nan=True)["error"]
    status = c.call(P.STATUS, timeout=30)
    assert (status["method"], status["replicas"], status["shards"], status["world"]) == ("fl-fsdp", 1, 1, 1)
    assert os.stat(status["handoff_dir"]).st_mode & 0o777 == 0o700  # fresh and private (mkdtemp)
    with pytest.raises(GroupError, match="send hello first"):
        c.call(P.TRAIN, {"job": "x"}, timeout=30)
    # a run config the group cannot run: refused with both layouts named, nothing built
    refused = c.call(P.HELLO, {"run": spec(data_dir, shards=2).to_json(), "partition_id": 0,
                               "num_partitions": 1}, timeout=60)
    assert not refused["compatible"] and "S=2 = 2 ranks" in refused["error"] and "S=1 = 1 ranks" in refused["error"]
    missing = c.call(P.HELLO, {"run": spec(tmp_path / "nodata", shards=1).to_json(), "partition_id": 0,
                               "num_partitions": 1}, timeout=60)
    assert not missing["compatible"] and "prepare-data" in missing["error"]
    assert missing["error"].startswith(f"run config data directory {tmp_path / 'nodata'} ('data-dir') does not exist")
    # a run: hello builds the trainer (a second hello of the same run reuses it), evaluate, finish with a save
    ok = hello(c, spec(data_dir, shards=1), 0, 1)
    assert ok["fingerprint"] and ok["steps"] == 0 and ok["partition_id"] == 0
    assert hello(c, spec(data_dir, shards=1), 0, 1)["fingerprint"] == ok["fingerprint"]
    evaluated = c.call(P.EVALUATE, timeout=60)
    assert evaluated["eval_loss"] > 0 and evaluated["eval_ppl"] > 1
    finished = c.call(P.FINISH, {"save_dir": str(tmp_path / "model")}, timeout=120)
    assert finished["saved"] and (tmp_path / "model" / "config.json").is_file()
    assert c.call(P.STATUS, timeout=30)["run_key"] == ""  # the run's trainer is gone, the group still serves
    c.call(P.SHUTDOWN, timeout=30)
    wait_until(lambda: all_gone(pids), 30, what="group exit after shutdown")
    assert proc.popen.wait(timeout=5) == 0


@pytest.mark.timeout(240)
def test_group_exits_when_idle_when_its_watched_process_ends_and_when_a_rank_or_launcher_dies(procs):
    sleeper = procs.start("sleeper", ["sleep", "300"])
    (watched, w_address, w_key), (rank_dies, r_address, r_key), (launcher_dies, l_address, l_key) = start_groups(
        procs, [("watched", dict(shards=1, extra=["--watch-pid", str(sleeper.pid)])), ("rank", dict(shards=2)),
                ("launcher", dict(shards=2))])
    watched_pids = [watched.pid, *group_pids(w_address, w_key)]
    rank_pids = [rank_dies.pid, *group_pids(r_address, r_key)]
    launcher_pids = [launcher_dies.pid, *group_pids(l_address, l_key)]
    idle, idle_address, idle_key = start_group(procs, "idle", shards=1, idle_timeout=3)
    idle_pids = [idle.pid, *group_pids(idle_address, idle_key)]
    procs.track(*idle_pids, *watched_pids, *rank_pids, *launcher_pids)

    procs.kill(sleeper)
    os.kill(rank_pids[2], signal.SIGKILL)  # rank 1 of a 2-rank group
    os.kill(launcher_pids[0], signal.SIGKILL)  # the torchrun launcher itself
    wait_until(lambda: all_gone(idle_pids), 30, what="idle group exit")
    wait_until(lambda: all_gone(watched_pids), 30, what="exit after the watched process ended")
    wait_until(lambda: all_gone(rank_pids), 60, what="group exit after a rank died")
    wait_until(lambda: all_gone(launcher_pids), 30, what="ranks exit after their launcher was killed")
    assert "no instruction for 3 s" in idle.text()
    assert f"watched process {sleeper.pid} is gone" in watched.text()


def _static_losses(data_dir: Path, tmp: Path, run: FlowerRun, federations: int) -> tuple[list[float], list[dict]]:
    t, p, k = run.train, run.train.parallel, run.federation.syncs_per_round
    result = train_ranks(federations * run.group_world, [
        "--method", p.method, "--federations", str(federations), "--replicas", str(p.replicas), "--shards",
        str(p.shards), "--model", t.model.name, "--data-dir", str(data_dir), "--seq-len", str(t.data.seq_len),
        "--batch-size", str(t.batch_size), "--eval-blocks", str(t.data.eval_blocks), "--steps", str(run.total_steps),
        "--aggregate-every", str(p.aggregate_every), "--lr", str(t.optim.lr), "--warmup", str(t.optim.warmup),
        "--min-lr-ratio", str(t.optim.min_lr_ratio), "--weight-decay", str(t.optim.weight_decay), "--grad-clip",
        str(t.optim.grad_clip), "--seed", str(t.seed), "--log-every", "1",
        "--eval-every", str(k * p.aggregate_every), "--run-dir", str(tmp / "static"), "--no-save-model",
        "--no-progress", "--sync-dtype", p.sync_dtype, *(["--sync-error-feedback"] if p.sync_error_feedback else []),
        *(["--sync-topk", str(p.sync_topk)] if p.sync_topk else [])], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp / "static" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"], [r for r in records if r["kind"] == "eval"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout, sync", [
    (dict(method="fl-hsdp", replicas=2, shards=1), {}),
    (dict(method="fl-hsdp", replicas=2, shards=1), dict(sync_dtype="int4", sync_error_feedback=True, sync_topk=0.1)),
], ids=["fl-hsdp", "fl-hsdp-topk-int4"])
def test_groups_sync_identical_shards_and_match_the_static_engine(procs, data_dir, tmp_path, layout, sync):
    """Two groups, 2 rounds of K=2 syncs x A=3 steps, against `torchrun -m flwr_sharded.train` with F=2.

    fl-hsdp here (replica 0 syncs, then broadcasts inside the group), with the fp32 sync and with the top-k sync of
    int4 values; fl-fsdp is compared end to end through Flower in test_simulation.py.

    Tolerance: 1e-5 absolute on every step's loss (mean over all ranks) and on the held-out loss after each round
    (same seeds, same samples; in practice the curves are bit-identical). After every sync, the checksum of every
    rank's local shards is identical across groups and, for fl-hsdp, across the replicas of a group.
    """
    s = spec(data_dir, **layout, **sync)
    groups = start_groups(procs, [(f"g{i}", layout) for i in range(2)])
    clients = [client(a, k) for _, a, k in groups]
    hellos = [hello(c, s, i, 2) for i, c in enumerate(clients)]
    assert hellos[0]["fingerprint"] == hellos[1]["fingerprint"]
    losses, evals = [], []
    K, W, p = s.federation.syncs_per_round, s.group_world, s.train.parallel
    for r in range(s.federation.rounds):
        out = train_all(clients, hellos[0], f"test/round{r}", syncs=None, steps=None)  # the run's K and A
        for o in out:
            assert o["syncs"] == K and not o["sync_failed"]
            assert len(o["checksums"]) == K * W
        assert out[0]["checksums"] == out[1]["checksums"]
        for k in range(K):
            sums = out[0]["checksums"][k * W:(k + 1) * W]
            for rep in range(1, p.replicas):
                assert sums[rep * p.shards:(rep + 1) * p.shards] == sums[:p.shards]
        losses += [(a + b) / 2 for a, b in zip(out[0]["losses"], out[1]["losses"])]
        assert out[0]["eval_loss"] == out[1]["eval_loss"]
        evals.append(out[0]["eval_loss"])
    static_losses, static_evals = _static_losses(data_dir, tmp_path, s, federations=2)
    assert losses == pytest.approx(static_losses, abs=1e-5)
    assert evals == pytest.approx([e["eval_loss"] for e in static_evals], abs=1e-5)
    assert losses[-1] < losses[0] - (0.1 if p.sync_topk else 0.3)  # it trained (top-k: only what it sent syncs)


@pytest.mark.timeout(300)
def test_a_dead_group_makes_the_sync_fail_and_the_survivors_roll_back(procs, data_dir):
    """Three groups of one rank; the third crashes right after its first sync.

    Round 1 (members A, B, C; K=2): sync 1 succeeds everywhere, C dies, sync 2 fails for A and B, which restore the
    shards of sync 1. Round 2 still names C (its node has not noticed): the rendezvous gives up within its timeout
    and nothing changes. Round 3 (A, B) syncs again.
    """
    s = spec(data_dir, shards=1, syncs_per_round=2, aggregate_every=2, rounds=3)
    groups = start_groups(procs, [(f"g{i}", dict(shards=1, env=faults_env(exit_after_syncs=1) if i == 2 else None))
                                  for i in range(3)])
    clients = [client(a, k) for _, a, k in groups]
    hellos = [hello(c, s, i, 3) for i, c in enumerate(clients)]
    dead_pids = [groups[2][0].pid, *hellos[2]["pids"]]

    start = time.monotonic()
    out = train_all(clients, hellos[0], "t/round1", syncs=2, steps=2, sync_timeout=10.0, may_fail=(2,))
    assert time.monotonic() - start < 60  # the failed collective gives up within the sync timeout
    assert isinstance(out[2], GroupUnavailable), out[2]  # the crashed group's caller sees the connection drop
    out = out[:2]
    for o in out:
        assert (o["syncs"], o["sync_failed"], o["steps"]) == (1, True, 4), o.get("sync_error")
        assert "shard 0:" in o["sync_error"]
    assert out[0]["checksums"] == out[1]["checksums"]  # the sync that succeeded
    wait_until(lambda: all_gone(dead_pids), 60, what="the crashed group's exit")
    after_rollback = [c.call(P.STATUS, timeout=30)["checksums"] for c in clients[:2]]
    assert after_rollback[0] == after_rollback[1] == out[0]["checksums"]  # rolled back to the last synced shards
    assert out[0]["eval_loss"] == out[1]["eval_loss"]

    start = time.monotonic()
    out = train_all(clients[:2], hellos[0], "t/round2", syncs=2, steps=2, members=3, rendezvous_timeout=5.0)
    assert time.monotonic() - start < 60
    for o in out:
        assert (o["syncs"], o["sync_failed"]) == (0, True)
        assert "did not arrive" in o["sync_error"] and "[2]" in o["sync_error"]
        assert o["sync_blame"] == [2]  # the ServerApp counts it against member 2 (max-strikes)
    print(f"\nabsent member: the others gave up after {max(o['sync_s'] for o in out):.1f} s (rendezvous-timeout 5 s)")
    assert [c.call(P.STATUS, timeout=30)["checksums"] for c in clients[:2]] == after_rollback

    out = train_all(clients[:2], hellos[0], "t/round3", syncs=2, steps=2)
    for o in out:
        assert (o["syncs"], o["sync_failed"]) == (2, False)
    assert out[0]["checksums"] == out[1]["checksums"]
    assert out[0]["checksums"][:1] != after_rollback[0]


@pytest.mark.timeout(240)
def test_a_sync_that_fails_for_one_member_after_the_others_finished_is_rolled_back_by_all(procs, data_dir):
    """Two groups of one rank. B brings NaN shards and moments to its first sync: it is left out of it, adopts A's
    shards and the optimizer state of its last commit (finite). B's second sync fails on B after the reduction
    succeeded everywhere (A has its result). The commit vote makes both roll back at once, not after a timeout:
    shards, optimizer moments, step and learning rate are those of the first sync on both, both name B, and the
    next round syncs them again."""
    s = spec(data_dir, shards=1, aggregate_every=2, syncs_per_round=1, rounds=3)
    faults = faults_env(nan_sync=1, fail_sync=2)
    groups = start_groups(procs, [("a", dict(shards=1)), ("b", dict(shards=1, env=faults))])
    clients = [client(a, k) for _, a, k in groups]
    offer = hello(clients[0], s, 0, 2)
    hello(clients[1], s, 1, 2)
    out = train_all(clients, offer, "vote/round1", syncs=1, steps=2, sync_timeout=20.0)
    assert [(o["syncs"], o["sync_failed"], o["sync_left_out"]) for o in out] == [(1, False, [1])] * 2
    committed = [c.call(P.STATUS, timeout=30) for c in clients]
    assert committed[0]["checksums"] == committed[1]["checksums"] == out[0]["checksums"]  # B healed by A's mean
    assert all(math.isfinite(c) for c in committed[1]["optimizer_checksums"])

    out = train_all(clients, offer, "vote/round2", syncs=1, steps=2, sync_timeout=20.0)
    for o in out:
        assert (o["syncs"], o["sync_failed"], o["sync_blame"]) == (0, True, [1]), o.get("sync_error")
        assert o["sync_s"] < 10  # told by B's vote, not by the 20 s sync timeout
    assert "member(s) [1] did not complete the sync" in out[0]["sync_error"]
    assert "injected fault: sync attempt 2 fails" in out[1]["sync_error"]
    for c, before in zip(clients, committed):
        now = c.call(P.STATUS, timeout=30)
        for key in ("checksums", "optimizer_checksums", "steps", "lr"):
            assert now[key] == before[key], key  # everything back at the first sync's commit
    assert committed[0]["checksums"] == committed[1]["checksums"]

    failed_s = [o["sync_s"] for o in out]

    out = train_all(clients, offer, "vote/round3", syncs=1, steps=2, sync_timeout=20.0)
    assert [(o["syncs"], o["sync_failed"], o["step"]) for o in out] == [(1, False, 4)] * 2
    assert out[0]["checksums"] == out[1]["checksums"] != committed[0]["checksums"]
    print(f"\ncommit vote: the failed sync took {failed_s[0]:.2f} s (A) and {failed_s[1]:.2f} s (B), rollback "
          f"included (sync-timeout 20 s); the next round's sync {out[0]['sync_s']:.2f} s")


def _join_unreachable(rank: int, world: int, port: int) -> float:
    from flwr_sharded.flower import rendezvous

    start = time.monotonic()
    with pytest.raises(rendezvous.RendezvousError, match="cannot reach the rendezvous store"):
        rendezvous.join(host="127.0.0.1", port=port, prefix="x", rank=1, size=2, rendezvous_timeout=2.0,
                        sync_timeout=2.0, secret=ROUND_SECRET, members=["a", "b"])
    return time.monotonic() - start


@pytest.mark.timeout(120)
def test_an_unreachable_rendezvous_fails_within_its_timeout():
    (seconds,) = run_ranks(_join_unreachable, 1, free_port(), timeout=90)
    assert seconds < 20


@pytest.mark.timeout(240)
def test_server_path_export_and_apply_check_every_piece_before_writing(procs, data_dir, tmp_path):
    """A group exports its own pieces per rank; a bad reply (missing piece, NaN, wrong shape) changes nothing, the
    good one is adopted by every rank, also when it comes cut into chunk files at other rows than the ranks'."""
    import numpy as np

    from flwr_sharded.flower import shard_files

    _, address, key = start_group(procs, "g0", shards=2)
    c = client(address, key)
    offer = hello(c, spec(data_dir, aggregation="server"), 0, 1)
    args = round_args(offer, "r1", 0, 1, syncs=1, steps=2, evaluate=False, export=True)
    out = train(c, {**args, "proximal-mu": 0.05, "lr": 0.01}, timeout=120)
    assert (out["steps"], out["proximal_mu"], out["peak_lr"]) == (2, 0.05, 0.01)  # the round's options arrived
    files = out["export_files"]
    assert len(files) == 2 and out["facility_tokens"] == out["tokens"] > 0  # one file per rank, a group alone
    from safetensors.numpy import load_file

    _, meta = shard_files.shard_manifest(files)  # also refuses a key in two files
    per_file = [load_file(f) for f in files]
    arrays = {k: v for values in per_file for k, v in values.items()}
    assert not per_file[0].keys() & per_file[1].keys() and set(arrays) == set(meta)  # each rank: its own rows
    before = c.call(P.STATUS)["checksums"]
    target = tmp_path / "apply.safetensors"
    some_key = next(k for k, v in arrays.items() if v.dtype == np.float32 and v.size > 1)
    bad = {"missing piece": {k: v for k, v in arrays.items() if k != some_key},
           "NaN": {**arrays, some_key: np.full_like(arrays[some_key], np.nan)},
           "wrong shape": {**arrays, some_key: arrays[some_key].reshape(-1)[:-1]}}
    for reason, values in bad.items():
        shard_files.write_file(target, values, {k: meta[k] for k in values})
        with pytest.raises(GroupError, match="nothing changed"):
            c.call(P.APPLY, {"paths": [str(target)]}, timeout=60)
        assert c.call(P.STATUS)["checksums"] == before, reason
    shifted = {k: (v + 1.0 if v.dtype == np.float32 else v) for k, v in arrays.items()}
    halves: list[tuple[dict, dict]] = [({}, {}), ({}, {})]  # every piece of 2+ rows cut in two, across two files
    for k, v in shifted.items():
        cut = v.shape[0] // 2 if v.ndim and v.shape[0] > 1 else 0
        if cut:
            for (values, tags), start, part in ((halves[0], 0, v[:cut]), (halves[1], cut, v[cut:])):
                values[shard_files.row_key(k, start)], tags[shard_files.row_key(k, start)] = part, meta[k]
        else:
            halves[0][0][k], halves[0][1][k] = v, meta[k]
    chunk_files = [tmp_path / "c0.safetensors", tmp_path / "c1.safetensors"]
    for path, (values, tags) in zip(chunk_files, halves):
        shard_files.write_file(path, values, tags)
    after = c.call(P.APPLY, {"paths": [str(f) for f in chunk_files], "evaluate": True}, timeout=60)
    assert after["checksums"] != before and math.isfinite(after["eval_loss"])
    assert after["checksums"] == c.call(P.STATUS)["checksums"]


@pytest.mark.timeout(300)
def test_a_restarted_group_catches_up_with_the_members_before_training(procs, data_dir):
    """Groups A and B sync; B is killed -9 and A goes on alone; a new B joins with a catch-up: before training, both
    hold A's shards (checksums), B takes A's step count and learning rate, and after the round's sync they agree."""
    s = spec(data_dir, outer="nesterov", aggregate_every=2, syncs_per_round=1, rounds=4)
    (_, a_addr, a_key), (_, b_addr, b_key) = start_groups(procs, [("a", {}), ("b", {})])
    a, b = client(a_addr, a_key), client(b_addr, b_key)
    offer = hello(a, s, 0, 2)
    hello(b, s, 1, 2)
    train_all([a, b], offer, "round1", syncs=1, steps=2)
    b_pids = group_pids(b_addr, b_key)
    for pid in b_pids:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: all_gone(b_pids), 60, what="group b gone")
    (alone,) = train_all([a], offer, "round2", syncs=1, steps=2)
    assert alone["syncs"] == 1 and not alone["sync_failed"]
    _, b_addr, b_key = start_group(procs, "b2")
    b = client(b_addr, b_key)
    assert hello(b, s, 1, 2)["steps"] == 0  # a fresh group
    jobs = [c.call(P.TRAIN, round_args(offer, "round3", i, 2, syncs=1, steps=2, catch_up=True, evaluate=False),
                   timeout=30, detach=True)["job"] for i, c in enumerate([a, b])]
    results = [c.collect(job, timeout=180) for c, job in zip([a, b], jobs)]
    got_a, got_b = results
    assert got_a is not None and got_b is not None, results
    assert got_a["catch_up_checksums"] == got_b["catch_up_checksums"] == alone["checksums"]
    assert got_a["step"] == got_b["step"] == 6 and got_a["lr"] == got_b["lr"]
    assert not got_a["sync_failed"] and got_a["checksums"] == got_b["checksums"]


@pytest.mark.timeout(300)
def test_a_dead_group_during_an_overlapped_int2_sync_makes_the_survivors_roll_back(procs, data_dir):
    """As above, with each sync started one step before its merge (tau = 1 of A = 2) and the 2-bit wire: C crashes
    after the first sync, so the next one, already in flight in A and B while they take their next step, fails
    within the sync timeout; both restore the shards and outer state of sync 1, and the next round syncs again."""
    s = spec(data_dir, shards=1, syncs_per_round=2, aggregate_every=2, rounds=2, sync_delay=1, sync_dtype="int2",
             sync_error_feedback=True, sync_carry=False)  # no carry: the groups hold the same shards after a merge
    groups = start_groups(procs, [(f"g{i}", dict(shards=1, env=faults_env(exit_after_syncs=1) if i == 2 else None))
                                  for i in range(3)])
    clients = [client(a, k) for _, a, k in groups]
    hellos = [hello(c, s, i, 3) for i, c in enumerate(clients)]

    start = time.monotonic()
    out = train_all(clients, hellos[0], "t/round1", syncs=2, steps=2, sync_timeout=10.0, may_fail=(2,))
    assert time.monotonic() - start < 60  # the overlapped sync's failure surfaces at its merge, within the timeout
    out = out[:2]
    for o in out:
        assert (o["syncs"], o["sync_failed"], o["steps"]) == (1, True, 4), o.get("sync_error")
        assert "shard 0:" in o["sync_error"]
    assert out[0]["checksums"] == out[1]["checksums"]  # the sync that succeeded
    after_rollback = [c.call(P.STATUS, timeout=30)["checksums"] for c in clients[:2]]
    assert after_rollback[0] == after_rollback[1] == out[0]["checksums"]

    out = train_all(clients[:2], hellos[0], "t/round2", syncs=2, steps=2)
    for o in out:
        assert (o["syncs"], o["sync_failed"]) == (2, False)
    assert out[0]["checksums"] == out[1]["checksums"]
    # what crossed was the 2-bit wire: each sync of the model's N values over 2 members sent the quantized ring's
    # bytes (a quarter of a byte a value plus a scale a block), 1/15 of the fp32 ring's 4 N
    from flwr_sharded.parallel.ring import all_reduce_bytes
    from flwr_sharded.training.models import build_meta_model, model_config

    n = sum(p.numel() for p in build_meta_model(model_config("tiny", vocab_size=8192, max_seq_len=32)).parameters())
    for o in out:
        assert o["sync_bytes"] == 2 * all_reduce_bytes(n, 2, "int2"), (o["sync_bytes"], n)
        assert 0.06 < o["sync_bytes"] / (2 * 4 * n) < 0.07


@pytest.mark.timeout(420)
def test_an_injected_failed_sync_ends_the_same_in_a_flower_group_and_in_the_static_engine(procs, data_dir, tmp_path):
    """Two groups of one rank; member 0 fails its second sync after the reduction (`fail_sync=2`, `tests/faults`). Through
    the group runtime (4 rounds of one sync of A = 2 steps: round 2 fails and rolls back) and in the static engine
    (the same failure, rolled back and retried), every step's loss and the held-out loss after every adopted sync
    agree within 1e-5: the same outer loop, the same rollback (shards, optimizer, step and schedule)."""
    s = spec(data_dir, shards=1, aggregate_every=2, syncs_per_round=1, rounds=4)
    groups = start_groups(procs, [("a", dict(shards=1, env=faults_env(fail_sync=2))), ("b", dict(shards=1))])
    clients = [client(a, k) for _, a, k in groups]
    offer = hello(clients[0], s, 0, 2)
    hello(clients[1], s, 1, 2)
    losses, evals = [], []
    for r in range(4):
        out = train_all(clients, offer, f"same/round{r}", syncs=None, steps=None)
        assert [o["sync_failed"] for o in out] == [r == 1] * 2
        round_losses = [(a + b) / 2 for a, b in zip(out[0]["losses"], out[1]["losses"])]
        losses += round_losses[:-1] if r == 1 else round_losses  # the static log drops the failed sync's step
        if r != 1:
            evals.append(out[0]["eval_loss"])
    result = train_ranks(2, ["--method", "fl-fsdp", "--federations", "2", "--shards", "1", "--model", "tiny",
                          "--data-dir", str(data_dir), "--seq-len", "32", "--batch-size", "2", "--eval-blocks", "8",
                          "--steps", str(s.total_steps), "--aggregate-every", "2", "--lr", str(s.train.optim.lr),
                          "--seed", str(s.train.seed), "--log-every", "1", "--eval-every", "2",
                          "--run-dir", str(tmp_path / "static"), "--no-save-model", "--no-progress"], timeout=300,
                      env=faults_env(fail_sync=2))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "static" / "metrics.jsonl").read_text().splitlines()]
    static = [r["loss"] for r in records if r["kind"] == "train"]
    assert [r["step"] for r in records if r["kind"] == "sync_failed"] == [4]
    assert losses == pytest.approx(static[:len(losses)], abs=1e-5)
    assert evals == pytest.approx([r["eval_loss"] for r in records if r["kind"] == "eval"][:3], abs=1e-5)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("topk", [None, 0.1], ids=["int8", "topk-int8"])
def test_a_round_of_members_at_two_sites_reduces_in_two_levels_as_the_static_engine_does(procs, data_dir, tmp_path,
                                                                                         topk):
    """Four groups of one rank at sites a, a, b, b, one round of K=2 syncs x A=2 steps through the int8 wire (which
    rounds only across sites in two levels), or top-10% with int8 values (`parallel.sparse_sites`): every member
    ends with the same shards, and the losses equal those of `torchrun -m flwr_sharded.train --sync-sites a,a,b,b`
    bit for bit (a flat ring's differ from the third step on, by about 5e-6)."""
    sites = ["a", "a", "b", "b"]
    s = spec(data_dir, shards=1, aggregate_every=2, rounds=1, sync_dtype="int8", sync_error_feedback=True,
             **({"sync_topk": topk} if topk else {}))
    groups = start_groups(procs, [(f"g{i}", dict(method="fl-fsdp", replicas=1, shards=1)) for i in range(4)])
    clients = [client(a, k) for _, a, k in groups]
    offer = [hello(c, s, i, 4) for i, c in enumerate(clients)][0]
    jobs = [c.call(P.TRAIN, round_args(offer, "test/sites", i, 4, member_sites=sites), timeout=30,
                   detach=True)["job"] for i, c in enumerate(clients)]
    out = [c.collect(job, timeout=180) for c, job in zip(clients, jobs)]
    assert all(o["two_level"] and not o["sync_failed"] and o["syncs"] == 2 for o in out), out
    assert all(o["checksums"] == out[0]["checksums"] for o in out)
    losses = [sum(o["losses"][k] for o in out) / 4 for k in range(len(out[0]["losses"]))]
    result = train_ranks(4, ["--method", "fl-fsdp", "--federations", "4", "--shards", "1",
                             "--sync-sites", ",".join(sites),
                          "--model", "tiny", "--data-dir", str(data_dir), "--seq-len", "32", "--batch-size", "2",
                          "--eval-blocks", "8", "--steps", "4", "--aggregate-every", "2", "--lr", "3e-3", "--seed", "3",
                          "--warmup", str(s.train.optim.warmup), "--min-lr-ratio", str(s.train.optim.min_lr_ratio),
                          "--weight-decay", str(s.train.optim.weight_decay),
                          "--grad-clip", str(s.train.optim.grad_clip),
                          "--log-every", "1", "--eval-every", "0", "--run-dir", str(tmp_path / "static"),
                          "--no-save-model", "--no-progress", "--sync-dtype", "int8", "--sync-error-feedback",
                          *(["--sync-topk", str(topk)] if topk else [])],
                      timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "static" / "metrics.jsonl").read_text().splitlines()]
    assert losses == [r["loss"] for r in records if r["kind"] == "train"]  # bit for bit
