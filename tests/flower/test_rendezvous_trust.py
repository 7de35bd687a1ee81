"""Members-only rendezvous: stores bind the interface they are given, strangers who reach a round's store are never
counted and cannot take a member's slot or put their address into the process group, a proof for another node is
refused, and the news that a member is gone ends the wait at once. gloo on CPU, two spawned ranks, every wait
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


def _join(rank: int, port: int, prefix: str, members: list[str], delay: float, timeout: float,
          abort_after: float | None = None) -> dict:
    """Member `rank` (of `members`) joins; returns what happened: the all-reduce of rank+1, the keys it saw forged,
    or the error and how long it took."""
    import torch
    import torch.distributed as dist

    from flwr_sharded.flower import rendezvous

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


def _scenarios(rank: int, world: int, port: int) -> dict:
    """Both ranks: the stranger's round (rank 1 0.5 s after rank 0's proof). Then rank 0 alone: member 1 dead with a
    stranger in its slot (3 s timeout), a signed proof for another node, and the news that member 1 is gone (1 s into
    30 s)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if rank == 1:  # member 0 must have seen the forged proof before member 1 writes its own
        client, deadline = _store_client(port), time.monotonic() + 60
        while not client.check(["run1/round1/s0/member/0"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    out = {"stranger": _join(rank, port, "run1/round1/s0", MEMBERS, delay=0.5 * rank, timeout=20.0)}
    if rank == 0:
        out["dead slot"] = _join(0, port, "run1/round2/s0", MEMBERS, 0.0, 3.0)
        out["other node"] = _join(0, port, "run1/round3/s0", MEMBERS, 0.0, 10.0)
        out["gone"] = _join(0, port, "run1/round4/s0", MEMBERS, 0.0, 30.0, 1.0)
    return out


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


@pytest.mark.timeout(150)
def test_strangers_are_not_counted_cannot_take_a_slot_and_the_news_of_a_gone_member_ends_the_wait():
    """One store, four rounds (one spawn of two ranks, `_scenarios`):
    - a stranger writes a forged proof for member 1 before anyone arrives; member 0 sees it, member 1 comes 0.5 s
      after member 0's proof: the forged proof is not counted, the group forms with the two members and the
      all-reduce is theirs;
    - member 1 is dead and a stranger writes its proof (and the old arrival marker): member 0 fails at the
      rendezvous timeout, naming the missing member and the unsigned values;
    - member 1's slot holds a correctly signed proof (someone with the secret) that names another node: refused at
      once, not at the timeout;
    - member 1 never comes and 1 s into a 30 s rendezvous abort() says it is gone: member 0 stops waiting then."""
    import torch.distributed as dist

    from flwr_sharded.flower import rendezvous
    from flwr_sharded.flower.signed_store import SignedStore

    (store,) = rendezvous.serve_stores("127.0.0.1", 1)
    _stranger_writes(store.port, "run1/round1/s0", ["member/1"])
    _stranger_writes(store.port, "run1/round2/s0", ["member/1"])
    other = SignedStore(dist.PrefixStore("run1/round3/s0", _store_client(store.port)), ROUND_SECRET.encode(),
                        "run1/round3/s0", timeout=5.0)
    other.set("member/1", '{"node": "node-z", "rank": 1, "nonce": "n"}')
    out = run_ranks(_scenarios, 2, store.port, timeout=120)

    stranger = [o["stranger"] for o in out]
    assert [o.get("error", "") for o in stranger] == ["", ""]
    assert [o["sum"] for o in stranger] == [3.0, 3.0]
    assert "member/1" in stranger[0]["forged"]  # member 0 looked at it, and did not count it

    dead = out[0]["dead slot"]
    assert "member(s) [1] did not arrive within 3 s" in dead["error"]
    assert "not signed with the round's secret were written for member index(es) [1]" in dead["error"]
    assert 2.5 < dead["seconds"] < 15

    claimed = out[0]["other node"]
    assert "names node 'node-z'" in claimed["error"] and "listed node 'node-b'" in claimed["error"]
    assert claimed["seconds"] < 5

    gone = out[0]["gone"]
    assert "member(s) [1] are gone (test)" in gone["error"]
    assert 0.9 < gone["seconds"] < 5
    print(f"\nstranger: not counted (the round formed with its two members, member 0 waited "
          f"{stranger[0]['seconds']:.2f} s for member 1); a stranger in a dead member's slot: the wait "
          f"failed at its {dead['seconds']:.1f} s timeout (3 s); a proof for another node: refused after "
          f"{claimed['seconds']:.2f} s; abort: member 0 stopped waiting {gone['seconds']:.2f} s into a 30 s "
          f"rendezvous (told after 1 s)")


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
