"""Liveness on the group runtime (no Flower), one group of S=2 ranks: the news that a member is gone ends the
survivors' rendezvous wait at once, on every rank, and they roll back; a run whose ServerApp went silent is dropped
after its group-idle-timeout while the group keeps serving. (The same wait without the news runs to the rendezvous
timeout: tests/flower/test_group.py's dead-group test.) The group runs in its own session and is killed at the end."""

from __future__ import annotations

import time

import pytest

from flwr_sharded.flower import messages as P
from tests.flower.procs import start_group, wait_until
from tests.flower.test_faults import Round, arrived
from tests.flower.test_group import client, hello, round_args, spec

pytestmark = pytest.mark.dist  # every test here starts processes

RDV_TIMEOUT = 30.0


@pytest.mark.timeout(240)
def test_survivors_told_a_member_is_gone_stop_waiting_and_a_silent_run_is_dropped(procs, data_dir):
    """Member 1 of the round never comes (its group was lost). 1 s after both of group A's ranks reached the
    rendezvous, A's endpoint gets the abort the ServerApp sends: both ranks stop waiting at once, A rolls back and
    replies. Then the run goes silent (a group-idle-timeout of 3 s): the group drops it and still serves."""
    proc, address, key = start_group(procs, "A", shards=2)
    c = client(address, key)
    offer = hello(c, spec(data_dir, aggregate_every=2, syncs_per_round=1, rounds=4), 0, 2)
    procs.track(*offer["pids"])
    before = c.call(P.STATUS, timeout=30)["checksums"]
    told = Round([c], [round_args(offer, "gone/round1", 0, 2, syncs=1, steps=2, rendezvous_timeout=RDV_TIMEOUT,
                                  sync_timeout=RDV_TIMEOUT)]).start()
    wait_until(lambda: arrived(offer["rendezvous_host"], offer["rendezvous_ports"], "gone/round1", 0), 60,
               interval=0.05, what="group A at the rendezvous")
    time.sleep(1.0)
    start = time.monotonic()
    ack = c.call(P.ABORT, {"prefix": "gone/round1", "gone": [1], "reason": "test: group B was lost"}, timeout=10)
    assert ack["gone"] == [1]
    a = told.wait(0, 60)
    recovery_s = told.done_at[0] - start
    assert a["sync_failed"] and a["syncs"] == 0
    assert a["sync_error"].count("are gone (test: group B was lost") == 2  # both shard indices (ranks 0 and 1)
    assert recovery_s < 5 and a["sync_s"] < 6 < RDV_TIMEOUT
    assert c.call(P.STATUS, timeout=30)["checksums"] == before  # rolled back
    print(f"\nmember gone: told 1 s into a {RDV_TIMEOUT:.0f} s rendezvous wait, group A replied {recovery_s:.2f} s "
          f"after the abort ({a['sync_s']:.1f} s in its failed sync)")

    out = c.call(P.HELLO, {"run": spec(data_dir, aggregate_every=2, syncs_per_round=1, rounds=4).to_json(),
                           "run_key": "test", "partition_id": 0, "num_partitions": 2, "idle_timeout": 3.0},
                 timeout=120)  # the same run (no rebuild), now with a group-idle-timeout
    assert out["compatible"], out["error"]
    last = time.monotonic()
    assert c.call(P.STATUS, timeout=30)["run_key"]
    wait_until(lambda: "dropping the run" in proc.text(), 60, interval=0.2, what="the idle run dropped")
    dropped_s = time.monotonic() - last
    assert c.call(P.STATUS, timeout=30)["run_key"] == ""  # the trainer is gone, the group still serves
    assert 2.5 < dropped_s < 10 and proc.popen.poll() is None
    assert proc.text().count("built the trainer") == 1
    print(f"\nidle run: dropped {dropped_s:.1f} s after the last instruction (group-idle-timeout 3 s)")
