"""A group that lies about its own verdict, on the decentralised path (three groups of one rank, no Flower).

Group C's ranks carry the test-only hook `tests/faults` (nothing in the package can lie): before chosen sync
attempts it overwrites its shards with 1e30 or NaN and reports itself healthy. Each such sync must be rejected by
every member, the honest groups must end it exactly at their last commit, both must name C (`sync_blame`, which the
ServerApp's strikes count: `tests/flower/test_strategy.py` shows a member named by the others benched after
`max-strikes` rounds), and the next round without the liar must train with a finite loss.
"""

from __future__ import annotations

import math

import pytest

from flwr_sharded.flower import messages as P
from tests.flower.procs import start_groups
from tests.flower.test_group import client, hello, spec, train_all
from tests.multiproc import faults_env

pytestmark = pytest.mark.dist  # every test here starts processes


@pytest.mark.timeout(420)
def test_a_lying_member_is_never_adopted_and_is_named_in_every_round_it_lies(procs, data_dir):
    lie = faults_env(lie="1e30@2;nan@3,4")
    groups = start_groups(procs, [("a", dict(shards=1)), ("b", dict(shards=1)), ("c", dict(shards=1, env=lie))])
    clients = [client(a, k) for _, a, k in groups]
    run = spec(data_dir, shards=1, aggregate_every=2, syncs_per_round=1, rounds=5)
    offer = hello(clients[0], run, 0, 3)
    for i in (1, 2):
        hello(clients[i], run, i, 3)

    out = train_all(clients, offer, "lie/round1", syncs=1, steps=2)
    assert [(o["syncs"], o["sync_failed"]) for o in out] == [(1, False)] * 3
    committed = [c.call(P.STATUS, timeout=30)["checksums"] for c in clients[:2]]
    assert committed[0] == committed[1]

    seconds = {"adopted": max(o["sync_s"] for o in out)}
    for r, value in ((2, "1e30"), (3, "nan"), (4, "nan")):  # rejected, named, honest groups back at their commit
        out = train_all(clients, offer, f"lie/round{r}", syncs=1, steps=2)
        seconds[f"round {r} ({value})"] = max(o["sync_s"] for o in out[:2])
        for o in out[:2]:
            assert (o["syncs"], o["sync_failed"], o["sync_blame"]) == (0, True, [2]), (value, o["sync_error"])
            assert "member(s) [2] of the federation group sent it" in o["sync_error"]
        assert [c.call(P.STATUS, timeout=30)["checksums"] for c in clients[:2]] == committed, value

    out = train_all(clients[:2], offer, "lie/round5", syncs=1, steps=2)  # the liar benched: the others go on
    assert [(o["syncs"], o["sync_failed"]) for o in out] == [(1, False)] * 2
    assert all(math.isfinite(loss) for o in out for loss in o["losses"])
    assert out[0]["checksums"] == out[1]["checksums"] != committed[0]
    print("\nlying member: sync seconds (vote, offender search and rollback included):",
          {k: round(v, 2) for k, v in seconds.items()}, "; the next round without it:", round(out[0]["sync_s"], 2))
