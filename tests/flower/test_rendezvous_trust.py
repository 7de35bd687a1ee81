"""Members-only rendezvous: the store binds the interface it is given and admits only clients that prove the
round's secret, so a stranger who reaches it can neither read nor write nor make an honest member look absent; a
proof for another node is refused, and the news that a member is gone ends the wait at once. gloo on CPU, two
spawned ranks, every wait bounded (`tests.multiproc.run_ranks` kills every rank at the end)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from tests.flower.test_group import ROUND_SECRET
from tests.multiproc import run_ranks

MEMBERS = ["node-a", "node-b"]


def _client(port: int, scope: str, secret: str = ROUND_SECRET, timeout: float = 5.0):
    from flwr_sharded.flower.store_client import RoundStore

    return RoundStore.connect("127.0.0.1", port, scope, secret.encode(), deadline=time.monotonic() + timeout,
                              timeout=timeout)


def _raw_request(port: int, payload: bytes) -> bytes:
    """What a stranger without the secret gets back for `payload` (a frame header and bytes): all it reads."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.settimeout(5)
        received = sock.recv(4096)
        try:
            sock.sendall(payload)
            while chunk := sock.recv(4096):
                received += chunk
        except OSError:  # reset: the server closed on it
            pass
    return received


class Stranger(threading.Thread):
    """Until stopped: connects with a guessed secret and tries to write member proofs, and sends raw frames (a
    hello with a made-up proof, a write request, a frame header announcing 8 MiB)."""

    def __init__(self, port: int, scopes: list[str]) -> None:
        super().__init__(daemon=True)
        self.port, self.scopes, self.stop, self.attempts, self.admitted = port, scopes, threading.Event(), 0, 0

    def run(self) -> None:
        from flwr_sharded.flower import store_channel as ch
        from flwr_sharded.flower.store_client import StoreUnreachable

        while not self.stop.is_set():
            for scope in self.scopes:
                self.attempts += 1
                try:
                    _client(self.port, scope, "guessed secret, 32 bytes long!!", timeout=0.05).set("member/1", "x")
                    self.admitted += 1
                except StoreUnreachable:
                    pass
                hello = ch.pack(b"h", scope.encode(), b"\0" * 32, b"\0" * 32)
                for payload in (ch.plain_frame(hello), ch.plain_frame(ch.pack(ch.SET, b"member/1", b"x")),
                                struct.pack("!I", 8 << 20)):
                    _raw_request(self.port, payload)


def _join(rank: int, port: int, prefix: str, members: list[str], delay: float, timeout: float,
          abort_after: float | None = None) -> dict:
    """Member `rank` (of `members`) joins; returns what happened: the all-reduce of rank+1, or the error, the
    members it names missing and how long it took."""
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
        return {"error": str(exc), "missing": exc.missing, "seconds": time.monotonic() - start}
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=group.pg)
    group.destroy()
    return {"sum": float(value.item()), "seconds": time.monotonic() - start}


def _scenarios(rank: int, world: int, port: int) -> dict:
    """Both ranks: the round a stranger floods (rank 1 0.5 s after rank 0's proof). Then rank 0 alone: member 1 dead
    (3 s timeout), a proof for another node, and the news that member 1 is gone (1 s into 30 s)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if rank == 1:  # member 0's proof is there, under the stranger's flood, before member 1 writes its own
        client, deadline = _client(port, "run1/round1/s0"), time.monotonic() + 60
        while not client.check(["member/0"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        client.close()
    out = {"stranger": _join(rank, port, "run1/round1/s0", MEMBERS, delay=0.5 * rank, timeout=20.0)}
    if rank == 0:
        out["dead slot"] = _join(0, port, "run1/round2/s0", MEMBERS, 0.0, 3.0)
        out["other node"] = _join(0, port, "run1/round3/s0", MEMBERS, 0.0, 10.0)
        out["gone"] = _join(0, port, "run1/round4/s0", MEMBERS, 0.0, 30.0, 1.0)
    return out


def test_a_store_listens_on_the_rendezvous_host_only():
    """`serve_stores("127.0.0.1")` listens there and nowhere else (127.0.0.2 is loopback too, but refused)."""
    from flwr_sharded.flower import rendezvous

    server = rendezvous.serve_stores("127.0.0.1", 1)
    try:
        server.open_round("run1/round1", ROUND_SECRET, 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", server.ports[0]), timeout=2)
        client = _client(server.ports[0], "run1/round1/s0")
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        server.close()


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_stranger_flooding_the_store_changes_nothing_and_the_news_of_a_gone_member_ends_the_wait():
    """One store, four rounds (one spawn of two ranks, `_scenarios`), a stranger (`Stranger`) flooding every
    round's scope all along:
    - the members of round 1 meet and the all-reduce is theirs; the stranger was never admitted;
    - member 1 is dead: member 0 fails at the rendezvous timeout, naming member 1 (and only it);
    - member 1's slot holds a proof (written with the secret) that names another node: refused at once;
    - member 1 never comes and 1 s into a 30 s rendezvous abort() says it is gone: member 0 stops waiting then."""
    from flwr_sharded.flower import rendezvous

    server = rendezvous.serve_stores("127.0.0.1", 1)
    port = server.ports[0]
    scopes = [f"run1/round{r}/s0" for r in range(1, 5)]
    for r in range(1, 5):
        server.open_round(f"run1/round{r}", ROUND_SECRET, 1)
    _client(port, "run1/round3/s0").set("member/1", '{"node": "node-z", "rank": 1, "nonce": "n"}')
    stranger = Stranger(port, scopes)
    stranger.start()
    try:
        out = run_ranks(_scenarios, 2, port, timeout=120)
    finally:
        stranger.stop.set()
        stranger.join(30)
        server.close()

    assert stranger.attempts > 10 and stranger.admitted == 0
    met = [o["stranger"] for o in out]
    assert [o.get("error", "") for o in met] == ["", ""]
    assert [o["sum"] for o in met] == [3.0, 3.0]

    dead = out[0]["dead slot"]
    assert "member(s) [1] did not arrive within 3 s" in dead["error"] and dead["missing"] == [1]
    assert 2.5 < dead["seconds"] < 15

    claimed = out[0]["other node"]
    assert "names node 'node-z'" in claimed["error"] and "listed node 'node-b'" in claimed["error"]
    assert claimed["seconds"] < 5 and claimed["missing"] == []

    gone = out[0]["gone"]
    assert "member(s) [1] are gone (test)" in gone["error"]
    assert 0.9 < gone["seconds"] < 5
    print(f"\nstranger: {stranger.attempts} rounds of attempts, none admitted; the members met (member 0 waited "
          f"{met[0]['seconds']:.2f} s for member 1); a dead member: the wait failed at {dead['seconds']:.1f} s "
          f"(timeout 3 s); a proof for another node: refused after {claimed['seconds']:.2f} s; abort: member 0 "
          f"stopped waiting {gone['seconds']:.2f} s into a 30 s rendezvous (told after 1 s)")


def test_a_client_without_the_secret_reads_and_writes_nothing():
    """A member's keys are not readable without the round's secret: a raw request gets the greeting and a closed
    connection, a guessed secret and another round's secret are refused, and each round (scope) sees only its own
    keys. A server that does not know the secret is refused by the client."""
    from flwr_sharded.flower import rendezvous
    from flwr_sharded.flower import store_channel as ch
    from flwr_sharded.flower.store_client import StoreUnreachable
    from flwr_sharded.flower.store_server import round_scopes

    server = rendezvous.serve_stores("127.0.0.1", 1)
    port = server.ports[0]
    other_secret = "another secret, 32 bytes long!!"
    try:
        server.open_round("r1", ROUND_SECRET, 1)
        server.open_round("r2", other_secret, 1)
        _client(port, "r1/s0").set("addr/0", b"10.0.0.1:5000")
        for payload in (ch.plain_frame(ch.pack(ch.GET, b"addr/0")),
                        ch.plain_frame(ch.pack(b"h", b"r1/s0", b"\0" * 32, b"\0" * 32)), b"\0" * 64):
            received = _raw_request(port, payload)
            assert received.startswith(ch.GREETING) and len(received) == len(ch.GREETING) + ch.NONCE_BYTES
        for scope, secret in (("r1/s0", "guessed secret, 32 bytes long!!"), ("r1/s0", other_secret),
                              ("r3/s0", ROUND_SECRET)):
            start = time.monotonic()
            with pytest.raises(StoreUnreachable, match="refused"):
                _client(port, scope, secret, timeout=0.5)
            assert time.monotonic() - start < 3
        round2 = _client(port, "r2/s0", other_secret)
        assert round2.peek("addr/0") is None and round2.num_keys() == 0
        server.close_scopes(round_scopes("r1", 1))
        with pytest.raises(StoreUnreachable):
            _client(port, "r1/s0", timeout=0.5)
    finally:
        server.close()

    with socket.socket() as fake:  # answers the greeting, cannot answer the proof
        fake.bind(("127.0.0.1", 0))
        fake.listen()
        fake.settimeout(1)

        def impostor() -> None:
            while True:
                try:
                    conn, _ = fake.accept()
                except OSError:
                    return
                with conn:
                    conn.sendall(ch.GREETING + b"\0" * ch.NONCE_BYTES)
                    conn.recv(4096)
                    conn.sendall(ch.ACCEPT + b"\0" * ch.MAC_BYTES)
        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        with pytest.raises(StoreUnreachable, match="did not prove the round's secret"):
            _client(fake.getsockname()[1], "r1/s0", timeout=0.3)
        thread.join(5)


def test_a_member_kept_out_by_a_stranger_holding_the_store_is_not_blamed(monkeypatch):
    """A stranger holds every connection slot the store keeps for unproven clients (each for the server's
    handshake time, longer than the rendezvous): member 1 cannot get in, and neither member names anyone missing
    (the store turned connections away while they waited). One process, two threads, 2 s rendezvous."""
    from flwr_sharded.flower import rendezvous
    from flwr_sharded.flower import store_server as srv

    monkeypatch.setattr(srv, "MAX_PENDING", 4)
    server = rendezvous.serve_stores("127.0.0.1", 1)
    port = server.ports[0]
    server.open_round("run1/round1", ROUND_SECRET, 1)
    member0 = _client(port, "run1/round1/s0")  # member 0 is in before the stranger starts
    held = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(srv.MAX_PENDING)]
    outcomes: dict[int, rendezvous.RendezvousError] = {}

    def member(rank: int) -> None:
        try:
            if rank == 0:
                rendezvous._arrive(member0, "run1/round1/s0", 0, MEMBERS, time.monotonic() + 2.0, 2.0)
            else:
                rendezvous.join(host="127.0.0.1", port=port, prefix="run1/round1/s0", rank=1, size=2,
                                rendezvous_timeout=2.0, sync_timeout=2.0, secret=ROUND_SECRET, members=MEMBERS)
        except rendezvous.RendezvousError as exc:
            outcomes[rank] = exc
    try:
        time.sleep(0.3)
        threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for sock in held:
            sock.close()
        server.close()
    assert "turned" in str(outcomes[0]) and "nobody is held at fault" in str(outcomes[0])
    assert "cannot reach the rendezvous store" in str(outcomes[1])
    assert outcomes[0].missing == [] and outcomes[1].missing == []


def test_a_stranger_on_one_host_cannot_fill_the_store_alone():
    """From one source address (127.0.0.2) a stranger holds at most MAX_PENDING_PER_HOST unproven connections; a
    further one is closed at once, and a member from another address (127.0.0.1) still gets in at once."""
    from flwr_sharded.flower import rendezvous
    from flwr_sharded.flower import store_server as srv

    server = rendezvous.serve_stores("127.0.0.1", 1)
    port = server.ports[0]
    server.open_round("run1/round1", ROUND_SECRET, 1)
    held = []
    try:
        for _ in range(srv.MAX_PENDING_PER_HOST + 1):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.settimeout(2)
            sock.connect(("127.0.0.1", port))
            held.append(sock)
        time.sleep(0.2)
        assert held[-1].recv(4096) == b""  # the one too many: closed without a greeting
        start = time.monotonic()
        member = _client(port, "run1/round1/s0")
        assert time.monotonic() - start < 1 and member.turned_away() == 1
    finally:
        for sock in held:
            sock.close()
        server.close()
