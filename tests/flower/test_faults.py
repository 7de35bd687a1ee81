"""Fault injection on the group runtime (no Flower): one rank killed mid-step, a whole group frozen (SIGSTOP) during a
round, one rank frozen inside a sync. Each test asserts the survivors give up within their rendezvous/sync timeout,
roll back to their last synced shards and that nothing is left running; it prints the measured recovery time
(docs/flower.md, "Faults and recovery"). Every group runs in its own session and is killed in a `finally`."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from flwr_sharded.flower import messages as P
from flwr_sharded.flower.endpoint import GroupClient, GroupError, GroupUnavailable
from tests.flower.procs import Proc, pid_alive, start_groups, wait_until
from tests.flower.test_group import ROUND_SECRET, all_gone, client, hello, round_args, spec, train, train_all
from tests.faults.cut_link import run_cut
from tests.multiproc import faults_env, needs_emulation

pytestmark = pytest.mark.dist  # every test here starts processes

RDV_TIMEOUT = 8.0
SYNC_TIMEOUT = 8.0


@dataclass
class Round:
    """One train instruction per group, sent at once from threads; each reply (or exception) is time-stamped."""

    clients: list[GroupClient]
    args: list[dict[str, Any]]
    replies: list[Any] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Round:
        self.replies = [None] * len(self.clients)
        self.done_at = [0.0] * len(self.clients)
        self.threads = [threading.Thread(target=self._call, args=(i,), daemon=True) for i in range(len(self.clients))]
        for t in self.threads:
            t.start()
        return self

    def _call(self, i: int) -> None:
        try:
            self.replies[i] = train(self.clients[i], self.args[i], timeout=150)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            self.replies[i] = exc
        self.done_at[i] = time.monotonic()

    def wait(self, i: int, timeout: float) -> Any:
        self.threads[i].join(timeout)
        if self.threads[i].is_alive():
            raise TimeoutError(f"group {i} did not answer its train instruction within {timeout:.0f} s")
        return self.replies[i]


def train_round(clients: list[GroupClient], offer: dict, prefix: str, *, syncs: int, steps: int) -> Round:
    args = [round_args(offer, prefix, i, len(clients), syncs=syncs, steps=steps, rendezvous_timeout=RDV_TIMEOUT,
                       sync_timeout=SYNC_TIMEOUT) for i in range(len(clients))]
    return Round(clients, args).start()


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_for_log(proc: Proc, text: str, timeout: float) -> None:
    wait_until(lambda: text in proc.text(), timeout, interval=0.05, what=f"{text!r} in {proc.name}'s log")


def arrived(host: str, ports: list[int], prefix: str, member: int) -> bool:
    """True once `member`'s ranks of every shard index have reached the round's rendezvous (its stores' keys)."""
    from flwr_sharded.flower.store_client import RoundStore, StoreUnreachable

    for s, port in enumerate(ports):
        try:
            store = RoundStore.connect(host, port, f"{prefix}/s{s}", ROUND_SECRET.encode(),
                                       deadline=time.monotonic() + 1.0, timeout=5.0)
        except StoreUnreachable:  # the round is not open at its host yet
            return False
        try:
            if not store.check([f"member/{member}"]):
                return False
        finally:
            store.close()
    return True


def restored(c: GroupClient, reply: dict, before: list[float], world: int) -> bool:
    """The group's shards are those of its last successful sync: of this round if any, else `before`."""
    last_synced = reply["checksums"][-world:] if reply["syncs"] else before
    return c.call(P.STATUS, timeout=30)["checksums"] == last_synced


@pytest.mark.timeout(240)
def test_a_rank_killed_mid_step_tears_its_group_down_and_the_other_group_rolls_back(procs, data_dir):
    """Groups A and B (fl-fsdp, S=2) sync once; in round 2 rank 1 of B gets SIGKILL while it trains.

    B's torchrun tears the whole group down (launcher and both ranks gone); A finishes its steps, gives up at the
    rendezvous within its timeout (B never arrives), replies sync_failed with the shards of round 1 restored, and then
    trains and syncs on its own. Recovery time = SIGKILL -> A's reply.
    """
    s = spec(data_dir, aggregate_every=2, syncs_per_round=2, rounds=4)
    (proc_a, address_a, key_a), (proc_b, address_b, key_b) = start_groups(procs, [("A", {}), ("B", {})])
    clients = [client(address_a, key_a), client(address_b, key_b)]
    hellos = [hello(c, s, i, 2) for i, c in enumerate(clients)]
    pids_b = [proc_b.pid, *hellos[1]["pids"]]
    procs.track(*pids_b, *hellos[0]["pids"])

    out = train_all(clients, hellos[0], "kill/round1", syncs=1, steps=2)
    assert [o["sync_failed"] for o in out] == [False, False] and out[0]["checksums"] == out[1]["checksums"]
    synced = clients[0].call(P.STATUS, timeout=30)["checksums"]
    assert synced == out[0]["checksums"]

    steps, delay = 200, 1.0
    rnd = train_round(clients, hellos[0], "kill/round2", syncs=1, steps=steps)
    wait_for_log(proc_b, "received train (kill/round2)", 60)
    time.sleep(delay)  # well inside the 200 steps (about 0.05 s each)
    killed = time.monotonic()
    os.kill(hellos[1]["pids"][1], signal.SIGKILL)  # rank 1 of B: a worker, not the launcher
    wait_until(lambda: all_gone(pids_b), 60, interval=0.1, what="group B's exit after one of its ranks died")
    teardown_s = time.monotonic() - killed

    b = rnd.wait(1, 60)  # B's rank 0 reports the lost peer and exits, or torchrun kills it first
    assert isinstance(b, GroupUnavailable) or (isinstance(b, GroupError) and "the group exits" in str(b)), b
    a = rnd.wait(0, 120)
    recovery_s = rnd.done_at[0] - killed
    assert isinstance(a, dict), a
    assert (a["syncs"], a["sync_failed"], a["steps"]) == (0, True, steps)
    assert "did not arrive" in a["sync_error"] and "[1]" in a["sync_error"]
    assert a["train_s"] > 2 * delay  # A (same speed as B) was still training: B died mid-step
    assert a["sync_s"] < RDV_TIMEOUT + 5  # A gave up at the rendezvous timeout, no longer
    assert recovery_s < a["train_s"] + RDV_TIMEOUT + a["eval_s"] + 15
    assert clients[0].call(P.STATUS, timeout=30)["checksums"] == synced  # rolled back to round 1's shards

    alone = train_all(clients[:1], hellos[0], "kill/round3", syncs=1, steps=2)[0]  # A goes on by itself
    assert (alone["syncs"], alone["sync_failed"]) == (1, False)
    assert proc_a.popen.poll() is None and not any(pid_alive(p) for p in pids_b)
    print(f"\nrank SIGKILL: group B torn down in {teardown_s:.1f} s; group A replied {recovery_s:.1f} s after the "
          f"kill (its wait at the failed rendezvous: {a['sync_s']:.1f} s, rendezvous-timeout {RDV_TIMEOUT:.0f} s)")


@pytest.mark.timeout(240)
def test_a_frozen_group_does_not_hang_the_other_and_both_roll_back(procs, data_dir):
    """Group B (launcher and ranks) gets SIGSTOP while it trains the second period of round 1 (K=2 syncs): 1 s
    after both its ranks reached the round's rendezvous (each period takes a few seconds, the first sync
    milliseconds).

    A waits in a collective with a peer that neither answers nor closes its connections: it gives up within the
    sync timeout, replies sync_failed and holds the shards of its last successful sync. B then gets SIGCONT: it fails
    its own sync at once (A left the federation group), rolls back and answers too; then both are killed.
    Recovery time = SIGSTOP -> A's reply.

    Not covered: a freeze inside gloo's connection handshake (the first sync's first milliseconds); gloo retries the
    connect and the survivor then waits about 5 x sync-timeout (docs/flower.md, "Faults and recovery").
    """
    s = spec(data_dir, aggregate_every=2, syncs_per_round=2, rounds=4)
    (proc_a, address_a, key_a), (proc_b, address_b, key_b) = start_groups(procs, [("A", {}), ("B", {})])
    clients = [client(address_a, key_a), client(address_b, key_b)]
    hellos = [hello(c, s, i, 2) for i, c in enumerate(clients)]
    pids_a, pids_b = [proc_a.pid, *hellos[0]["pids"]], [proc_b.pid, *hellos[1]["pids"]]
    procs.track(*pids_a, *pids_b)
    before = [c.call(P.STATUS, timeout=30)["checksums"] for c in clients]

    steps = 80  # about 0.05 s each
    offer = hellos[0]
    rnd = train_round(clients, offer, "stop/round1", syncs=2, steps=steps)
    try:
        wait_until(lambda: arrived(offer["rendezvous_host"], offer["rendezvous_ports"], "stop/round1", 1), 90,
                   interval=0.05, what="group B at the rendezvous")
        time.sleep(1.0)  # past the first sync, into the second period's steps
        signal_all(pids_b, signal.SIGSTOP)
        stopped = time.monotonic()
        a = rnd.wait(0, 120)
        recovery_s = rnd.done_at[0] - stopped
        assert isinstance(a, dict), a
        assert a["sync_failed"] and a["syncs"] in (0, 1), a  # 1 unless the machine was too slow for the 1 s
        assert a["sync_s"] < SYNC_TIMEOUT + 5  # bounded by the sync timeout, not by B
        assert recovery_s < SYNC_TIMEOUT + a["train_s"] + a["eval_s"] + 15
        assert restored(clients[0], a, before[0], 2)
        assert all(pid_alive(p) for p in pids_b)  # frozen, not dead
    finally:
        signal_all(pids_b, signal.SIGCONT)
    resumed = time.monotonic()
    b = rnd.wait(1, SYNC_TIMEOUT + 60)
    resume_s = rnd.done_at[1] - resumed
    assert isinstance(b, dict), b
    assert b["sync_failed"], b
    assert restored(clients[1], b, before[1], 2)

    signal_all(pids_b + pids_a, signal.SIGKILL)
    wait_until(lambda: all_gone(pids_a + pids_b), 30, what="both groups gone after SIGKILL")
    print(f"\nSIGSTOP of a group: group A replied {recovery_s:.1f} s after the stop (failed sync after "
          f"{a['syncs']} good one(s), {a['sync_s']:.1f} s in syncs, sync-timeout {SYNC_TIMEOUT:.0f} s); group B "
          f"answered {resume_s:.1f} s after SIGCONT with sync_failed ({b['sync_error'][:60]}...)")


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP): its state in /proc is T."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "T"
    except (FileNotFoundError, IndexError):
        return False


FROZEN_SYNC_TIMEOUT = 15.0
"""Long enough that a second wait of the same length (a vote after the failed reduction) exceeds timeout + 10 s."""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_rank_frozen_inside_a_sync_is_left_behind_and_rejoins_with_the_global_model(procs, data_dir):
    """Three groups (fl-fsdp, S=2): A, B, C. Round 1 syncs all three. In round 2, rank 1 of B stops itself (SIGSTOP,
    the test-only hook `freeze_sync`) inside the round's first sync, once every member passed the admission: shard
    0's reduction completes on every member (and is merged into their shards), shard 1's waits for B.

    A and C give up within sync-timeout + 10 s of the freeze (their shard-1 collective times out; B's shard-0 rank,
    held in its own group by the frozen rank, never votes, so nobody waits a second timeout for its vote), both
    reply sync_failed and hold round 1's shards: no member keeps the half it reduced. Round 3 runs without B (A and
    C sync, equal checksums). B then gets SIGCONT (frozen for longer than the sync timeout): it is refused for round 2
    (its peers left: sync_failed, round 1's shards restored) and rejoins in round 4 with a catch-up: it adopts A's
    shards (the global model of round 3), and after the round's sync all three hold the same shards."""
    timeout = FROZEN_SYNC_TIMEOUT
    s = spec(data_dir, aggregate_every=2, syncs_per_round=1, rounds=8)
    started = start_groups(procs, [("A", {}), ("B", dict(env=faults_env(freeze_sync="2@1"))), ("C", {})])
    clients = [client(address, key) for _, address, key in started]
    hellos = [hello(c, s, i, 3) for i, c in enumerate(clients)]
    pids = [[proc.pid, *h["pids"]] for (proc, _, _), h in zip(started, hellos)]
    procs.track(*(p for group in pids for p in group))
    frozen = hellos[1]["pids"][1]  # rank 1 of B
    offer = hellos[0]

    out = train_all(clients, offer, "freeze/round1", syncs=1, steps=2, sync_timeout=timeout)
    assert [o["sync_failed"] for o in out] == [False] * 3 and out[0]["checksums"] == out[1]["checksums"]
    synced = out[0]["checksums"]

    args = [round_args(offer, "freeze/round2", i, 3, syncs=2, steps=2, rendezvous_timeout=30.0, sync_timeout=timeout)
            for i in range(3)]
    rnd = Round(clients, args).start()
    try:
        wait_until(lambda: stopped(frozen), 120, interval=0.05, what="rank 1 of B stopped inside its sync")
        frozen_at = time.monotonic()
        a, c = rnd.wait(0, timeout + 60), rnd.wait(2, timeout + 60)
        replied_s = [rnd.done_at[i] - frozen_at for i in (0, 2)]
        for o in (a, c):
            assert isinstance(o, dict), o
            assert (o["syncs"], o["sync_failed"]) == (0, True), o
            assert "shard 1" in o["sync_error"], o["sync_error"]
        assert max(replied_s) < timeout + 10, (replied_s, a["sync_error"])  # not a second timeout for B's vote
        restored_a, restored_c = (clients[i].call(P.STATUS, timeout=30)["checksums"] for i in (0, 2))
        assert restored_a == restored_c == synced  # shard 0's reduction, merged on every member, was undone

        without_b = [clients[0], clients[2]]  # the round goes on without the frozen group
        a3, c3 = train_all(without_b, offer, "freeze/round3", syncs=1, steps=2, sync_timeout=timeout)
        assert (a3["syncs"], a3["sync_failed"], c3["sync_failed"]) == (1, False, False)
        assert a3["checksums"] == c3["checksums"] != synced
        assert stopped(frozen) and time.monotonic() - frozen_at > timeout  # frozen for longer than the timeout
    finally:
        signal_all([frozen], signal.SIGCONT)
    resumed = time.monotonic()
    b = rnd.wait(1, timeout + 60)
    assert isinstance(b, dict), b
    assert (b["syncs"], b["sync_failed"]) == (0, True), b  # refused for round 2: its peers are gone
    assert clients[1].call(P.STATUS, timeout=30)["checksums"] == synced

    order = [clients[0], clients[2], clients[1]]  # B rejoins as member 2, catching up from A (member 0)
    jobs = [cl.call(P.TRAIN, round_args(offer, "freeze/round4", i, 3, syncs=1, steps=2, sync_timeout=timeout,
                                        catch_up=True), timeout=30, detach=True)["job"] for i, cl in enumerate(order)]
    a4, c4, b4 = (cl.collect(job, timeout=180) for cl, job in zip(order, jobs))
    assert a4["catch_up_checksums"] == c4["catch_up_checksums"] == b4["catch_up_checksums"] == a3["checksums"]
    assert not any(o["sync_failed"] for o in (a4, c4, b4))
    assert a4["checksums"] == c4["checksums"] == b4["checksums"]
    assert a4["step"] == b4["step"] and a4["lr"] == b4["lr"]
    print(f"\nrank 1 of B frozen inside a sync: A and C replied {replied_s[0]:.1f} / {replied_s[1]:.1f} s after the "
          f"freeze (sync-timeout {timeout:.0f} s, in syncs {a['sync_s']:.1f} / {c['sync_s']:.1f} s); B refused for "
          f"round 2 {rnd.done_at[1] - resumed:.1f} s after SIGCONT ({b['sync_error'][:80]}...), caught up in round 4")


@pytest.mark.slow
@needs_emulation
@pytest.mark.timeout(540)
def test_a_groups_uplink_cut_inside_a_sync_leaves_it_behind_and_it_rejoins_with_the_global_model(data_dir, tmp_path):
    """Three groups (fl-fsdp, S=2) on three nodes of the emulated network, each endpoint on its node's loopback (as
    for the ClientApp beside it): A, B, C. Round 1 syncs all three. In round 2, B's uplink goes down for 30 s while
    its rank 1 is inside the round's first sync (shard 0's reduction done everywhere, shard 1's waiting for it;
    `tests/faults/cut_link.py`). A and C reply sync_failed within sync-timeout + 10 s of the cut and hold round 1's
    shards; so does B, from its side of the cut. Round 3 runs without B while its link is still down (A and C sync,
    equal checksums). Once the link is back, B rejoins in round 4 with a catch-up from A (the global model of round
    3), after which all three hold the same shards."""
    seen = run_cut("flower", tmp_path, data_dir)
    timeout = seen["timeout"]
    assert not any(o["sync_failed"] for o in seen["round1"]), seen["round1"]
    synced = seen["round1"][0]["checksums"]
    a, b, c = seen["round2"]
    for o in (a, b, c):
        assert isinstance(o, dict) and (o["syncs"], o["sync_failed"]) == (0, True), o
    replied_s = [seen["round2_s"][i] for i in (0, 2)]
    assert max(replied_s) < timeout + 10, (replied_s, a["sync_error"])
    assert seen["status2"] == [synced] * 3  # nobody keeps the half it reduced
    a3, c3 = seen["round3"]
    assert (a3["syncs"], a3["sync_failed"], c3["sync_failed"]) == (1, False, False)
    assert a3["checksums"] == c3["checksums"] != synced
    assert seen["round3_s"] < seen["cut_s"]  # the round went on without B while its link was down
    a4, c4, b4 = seen["round4"]
    assert a4["catch_up_checksums"] == c4["catch_up_checksums"] == b4["catch_up_checksums"] == a3["checksums"]
    assert not any(o["sync_failed"] for o in (a4, c4, b4))
    assert a4["checksums"] == c4["checksums"] == b4["checksums"]
    print(f"\nB's uplink cut for {seen['cut_s']:.0f} s inside a sync: A and C replied {replied_s[0]:.1f} / "
          f"{replied_s[1]:.1f} s after the cut, B {seen['round2_s'][1]:.1f} s (sync-timeout {timeout:.0f} s); round 3 "
          f"without B ended {seen['round3_s']:.1f} s after the cut; B caught up in round 4 after the link came back")
