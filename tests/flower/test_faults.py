"""Fault injection on the group runtime (no Flower): one rank killed mid-step, a whole group frozen (SIGSTOP) during
a round. Each test asserts the survivors give up within their rendezvous/sync timeout, roll back to their last synced
shards and that nothing is left running; it prints the measured recovery time (docs/flower.md, "Faults and recovery").
Every group runs in its own session and is killed in a `finally`."""

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
