"""Liveness on the group runtime (no Flower): the news that a member is gone ends the survivors' rendezvous wait at
once, on every rank of the group (measured against the same wait without the news); a run whose ServerApp went
silent is dropped after its group-idle-timeout. Every group runs in its own session and is killed at the end."""

from __future__ import annotations

import signal
import time

import pytest

from flwr_sharded.flower import messages as P
from tests.flower.procs import start_group, start_groups, wait_until
from tests.flower.test_faults import Round, arrived, signal_all
from tests.flower.test_group import all_gone, client, hello, round_args, spec, train_all

RDV_TIMEOUT = 10.0


def member0_round(c, offer: dict, prefix: str) -> Round:
    """Member 0 of a round of two, started on `c` alone (member 1 is dead)."""
    return Round([c], [round_args(offer, prefix, 0, 2, syncs=1, steps=2, rendezvous_timeout=RDV_TIMEOUT,
                                  sync_timeout=RDV_TIMEOUT)]).start()


@pytest.mark.timeout(300)
def test_survivors_told_a_member_is_gone_stop_waiting_at_once(procs, data_dir):
    """Groups A and B (fl-fsdp, S=2) sync once; then B is killed. Round 2: A trains and waits at the rendezvous for
    B until its timeout (the old behaviour, the reference). Round 3: 1 s after both of A's ranks reached the
    rendezvous, A's endpoint gets the abort the ServerApp sends (as B's ClientApp reported the group lost): both
    ranks stop waiting at once, A rolls back and replies."""
    s = spec(data_dir, aggregate_every=2, syncs_per_round=1, rounds=4)
    (proc_a, address_a, key_a), (proc_b, address_b, key_b) = start_groups(procs, [("A", {}), ("B", {})])
    clients = [client(address_a, key_a), client(address_b, key_b)]
    hellos = [hello(c, s, i, 2) for i, c in enumerate(clients)]
    pids_b = [proc_b.pid, *hellos[1]["pids"]]
    procs.track(*pids_b, *hellos[0]["pids"])
    out = train_all(clients, hellos[0], "gone/round1", syncs=1, steps=2)
    assert [o["sync_failed"] for o in out] == [False, False]
    synced = clients[0].call(P.STATUS, timeout=30)["checksums"]
    signal_all(pids_b, signal.SIGKILL)
    wait_until(lambda: all_gone(pids_b), 30, what="group B gone")

    offer = hellos[0]
    waited = member0_round(clients[0], offer, "gone/round2")
    reference = waited.wait(0, 120)
    assert reference["sync_failed"] and "did not arrive" in reference["sync_error"]

    told = member0_round(clients[0], offer, "gone/round3")
    wait_until(lambda: arrived(offer["rendezvous_host"], offer["rendezvous_ports"], "gone/round3", 0), 60,
               interval=0.05, what="group A at the rendezvous")
    time.sleep(1.0)
    start = time.monotonic()
    ack = clients[0].call(P.ABORT, {"prefix": "gone/round3", "gone": [1], "reason": "test: group B was lost"},
                          timeout=10)
    assert ack["gone"] == [1]
    a = told.wait(0, 60)
    recovery_s = told.done_at[0] - start
    assert a["sync_failed"] and a["syncs"] == 0
    assert a["sync_error"].count("are gone (test: group B was lost") == 2  # both shard indices (ranks 0 and 1)
    assert recovery_s < 5 and a["sync_s"] < 6 < RDV_TIMEOUT <= reference["sync_s"]
    assert clients[0].call(P.STATUS, timeout=30)["checksums"] == synced  # rolled back
    assert proc_a.popen.poll() is None
    print(f"\nmember gone: without the news group A waited {reference['sync_s']:.1f} s at the rendezvous "
          f"(rendezvous-timeout {RDV_TIMEOUT:.0f} s); told 1 s into the wait, it replied {recovery_s:.2f} s after "
          f"the abort ({a['sync_s']:.1f} s in its failed sync)")


@pytest.mark.timeout(180)
def test_a_run_whose_serverapp_went_silent_is_dropped_after_its_idle_timeout(procs, data_dir):
    proc, address, key = start_group(procs, "g", shards=1)
    c = client(address, key)
    out = c.call(P.HELLO, {"run": spec(data_dir, shards=1).to_json(), "run_key": "silent", "partition_id": 0,
                           "num_partitions": 1, "idle_timeout": 3.0}, timeout=120)
    assert out["compatible"], out["error"]
    start = time.monotonic()
    assert c.call(P.STATUS, timeout=30)["run_key"]
    status_calls = time.monotonic()
    wait_until(lambda: "dropping the run" in proc.text(), 60, interval=0.2, what="the idle run dropped")
    dropped_s = time.monotonic() - status_calls
    assert c.call(P.STATUS, timeout=30)["run_key"] == ""  # the trainer is gone, the group still serves
    assert 2.5 < dropped_s < 10 and proc.popen.poll() is None
    print(f"\nidle run: dropped {dropped_s:.1f} s after the last instruction (group-idle-timeout 3 s; "
          f"{time.monotonic() - start:.1f} s after the hello)")
