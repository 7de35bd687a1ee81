"""Members-only rendezvous: stores bind the interface they are given, strangers who reach a round's store are never
counted and cannot take a member's slot or put their address into the process group, a proof for another node is
refused, and the news that a member is gone ends the wait at once. gloo on CPU, 1-2 spawned ranks, every wait
bounded (`tests.multiproc.run_ranks` kills every rank at the end)."""

from __future__ import annotations

import hashlib
import hmac
import socket
import time
from datetime import timedelta

import pytest

from tests.flower.test_group import ROUND_SECRET
from tests.multiproc import run_ranks

MEMBERS = ["node-a", "node-b"]


def _store_client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _stranger_writes(port: int, prefix: str, keys: list[str]) -> None:
    """A stranger (no secret) writes what a member would: a proof-looking value with a made-up tag, and the old
    protocol's arrival marker."""
    client = _store_client(port)
    fake = hmac.new(b"guessed" * 4, b"x", hashlib.sha256).digest()
    for key in keys:
        client.set(f"{prefix}/{key}", fake + b'{"node": "node-b", "rank": 1, "nonce": "0"}')
    client.set(f"{prefix}/arrived", "2")


def _join(rank: int, world: int, port: int, prefix: str, members: list[str], delay: float, timeout: float,
          abort_after: float | None = None) -> dict:
    """Member `rank` (of `members`) joins; returns what happened: the all-reduce of rank+1, the keys it saw forged,
    or the error and how long it took."""
    import torch
    import torch.distributed as dist

    from flwr_sharded.flower import rendezvous

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    time.sleep(delay)
    start = time.monotonic()
    def gone() -> str:
        return "member(s) [1] are gone (test)" if time.monotonic() - start > abort_after else ""

    abort = gone if abort_after is not None else None
    try:
        group = rendezvous.join(host="127.0.0.1", port=port, prefix=prefix, rank=rank, size=len(members),
                                rendezvous_timeout=timeout, sync_timeout=timeout, secret=ROUND_SECRET,
                                members=members, abort=abort)
    except rendezvous.RendezvousError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=group.pg)
    forged = sorted(group.store.forged)
    group.destroy()
    return {"sum": float(value.item()), "forged": forged, "seconds": time.monotonic() - start}


def test_a_store_listens_on_the_rendezvous_host_only():
    """`serve_stores("127.0.0.1")` listens there and nowhere else (127.0.0.2 is loopback too, but refused), unlike a
    bare TCPStore server, which listens on every interface."""
    import torch.distributed as dist

    from flwr_sharded.flower import rendezvous

    (store,) = rendezvous.serve_stores("127.0.0.1", 1)
    bare = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=5))
    socket.create_connection(("127.0.0.1", store.port), timeout=2).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", store.port), timeout=2)
    socket.create_connection(("127.0.0.2", bare.port), timeout=2).close()  # the old behaviour, for contrast
    _store_client(store.port).set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.timeout(120)
def test_a_stranger_is_not_counted_and_cannot_put_its_values_into_the_group():
    """Before the members arrive, a stranger writes a forged proof for member 1. Member 0 arrives first and sees it,
    member 1 a second later: the forged proof is not counted, the group forms with the two members only and the
    all-reduce is theirs (1 + 2)."""
    from flwr_sharded.flower import rendezvous

    (store,) = rendezvous.serve_stores("127.0.0.1", 1)
    prefix = "run1/round1/s0"
    _stranger_writes(store.port, prefix, ["member/1"])
    out = run_ranks(_join_by_rank, 2, store.port, prefix, timeout=90)
    assert [o.get("error", "") for o in out] == ["", ""]
    assert [o["sum"] for o in out] == [3.0, 3.0]
    assert "member/1" in out[0]["forged"]  # member 0 looked at it, and did not count it


def _join_by_rank(rank: int, world: int, port: int, prefix: str) -> dict:
    return _join(rank, world, port, prefix, MEMBERS, delay=1.0 * rank, timeout=20.0)


def test_the_signed_store_refuses_forged_replayed_and_foreign_values():
    """What gloo and NCCL read through the round's store (their peers' addresses, NCCL's unique id) must be signed
    with the round's secret, for this key and this round: a forged value, a good value copied under another key or
    into another round, and one signed with another secret all count as absent."""
    import torch.distributed as dist

    from flwr_sharded.flower import rendezvous
    from flwr_sharded.flower.signed_store import ForgedValue, SignedStore

    (server,) = rendezvous.serve_stores("127.0.0.1", 1)
    raw = _store_client(server.port)
    round1 = SignedStore(dist.PrefixStore("r1", raw), ROUND_SECRET.encode(), "r1", timeout=0.5)
    round2 = SignedStore(dist.PrefixStore("r2", raw), ROUND_SECRET.encode(), "r2", timeout=0.5)
    other = SignedStore(dist.PrefixStore("r1", raw), b"another secret, 32 bytes long!!", "r1", timeout=0.5)
    round1.set("addr/0", b"10.0.0.1:5000")
    assert round1.get("addr/0") == b"10.0.0.1:5000" and round1.check(["addr/0"])
    raw.set("r1/addr/1", raw.get("r1/addr/0"))  # replayed under another key
    raw.set("r2/addr/0", raw.get("r1/addr/0"))  # replayed into another round
    raw.set("r1/addr/2", b"\0" * 32 + b"10.6.6.6:6666")  # forged
    other.set("addr/3", b"10.6.6.6:6666")  # another secret
    for store, key in ((round1, "addr/1"), (round2, "addr/0"), (round1, "addr/2"), (round1, "addr/3")):
        assert store.verified(key) is None and not store.check([key])
        start = time.monotonic()
        with pytest.raises(ForgedValue, match="not signed with the round's secret"):
            store.get(key)
        assert time.monotonic() - start < 3
    with pytest.raises(TimeoutError):
        round1.wait(["addr/9"], timedelta(seconds=0.3))


@pytest.mark.timeout(120)
def test_a_stranger_cannot_take_a_dead_members_slot():
    """Member 1 is dead; a stranger without the secret writes its proof (and the old arrival marker). Member 0 does
    not count it: it fails at the rendezvous timeout, naming the missing member and the unsigned values."""
    from flwr_sharded.flower import rendezvous

    (store,) = rendezvous.serve_stores("127.0.0.1", 1)
    prefix = "run1/round2/s0"
    _stranger_writes(store.port, prefix, ["member/1"])
    (out,) = run_ranks(_join, 1, store.port, prefix, MEMBERS, 0.0, 3.0, timeout=90)
    assert "member(s) [1] did not arrive within 3 s" in out["error"]
    assert "not signed with the round's secret were written for member index(es) [1]" in out["error"]
    assert 2.5 < out["seconds"] < 15


def _claims_other_node(rank: int, world: int, port: int, prefix: str) -> dict:
    """Member 1's slot holds a correctly signed proof (someone with the secret) that names another node."""
    import torch.distributed as dist

    from flwr_sharded.flower.signed_store import SignedStore

    signed = SignedStore(dist.PrefixStore(prefix, _store_client(port)), ROUND_SECRET.encode(), prefix, timeout=5.0)
    signed.set("member/1", '{"node": "node-z", "rank": 1, "nonce": "n"}')
    return _join(0, 1, port, prefix, MEMBERS, 0.0, 10.0)


@pytest.mark.timeout(120)
def test_a_proof_for_a_node_the_serverapp_did_not_list_is_refused():
    from flwr_sharded.flower import rendezvous

    (store,) = rendezvous.serve_stores("127.0.0.1", 1)
    (out,) = run_ranks(_claims_other_node, 1, store.port, "run1/round3/s0", timeout=90)
    assert "names node 'node-z'" in out["error"] and "listed node 'node-b'" in out["error"]
    assert out["seconds"] < 5  # refused at once, not at the timeout


@pytest.mark.timeout(120)
def test_the_news_that_a_member_is_gone_ends_the_wait_at_once():
    """Member 1 never comes; 1 s into a 30 s rendezvous, abort() says it is gone: member 0 stops waiting then."""
    from flwr_sharded.flower import rendezvous

    (store,) = rendezvous.serve_stores("127.0.0.1", 1)
    (out,) = run_ranks(_join, 1, store.port, "run1/round4/s0", MEMBERS, 0.0, 30.0, 1.0, timeout=90)
    assert "member(s) [1] are gone (test)" in out["error"]
    assert 0.9 < out["seconds"] < 5
    print(f"\nabort: member 0 stopped waiting {out['seconds']:.2f} s into a 30 s rendezvous (told after 1 s)")
