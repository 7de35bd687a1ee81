"""A hostile or broken client on the group endpoint costs a bounded amount and never the endpoint: a handshake
deadline that trickled bytes do not extend, handshake caps (per peer address and in all) where a newcomer displaces
the oldest, malformed, deeply nested and NaN-bearing JSON answered with an error; key files and hand-off directories
private to their owner. In-process `EndpointServer` with a stand-in main loop (no torch)."""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import Client

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import endpoint as E
from flwr_sharded.flower import launch
from flwr_sharded.flower import messages as M

KEY = b"k" * 32


@contextmanager
def _endpoint(**caps):
    """An endpoint whose main loop answers every instruction with {"verb": ...}; stopped and closed at the end."""
    srv = E.EndpointServer(("127.0.0.1", 0), KEY, **caps)

    def main_loop() -> None:
        while True:
            request = srv.incoming.get()
            if request.verb == M.SHUTDOWN:
                request.reply(M.reply_ok())
                return
            request.reply(M.reply_ok({"verb": request.verb}))

    thread = threading.Thread(target=main_loop, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.incoming.put(E.Request(_NullConn(), M.SHUTDOWN, {}, False))
        thread.join(5)
        srv.close()


@pytest.fixture
def server():
    """An endpoint with a 1 s handshake deadline and 3 handshakes at once."""
    with _endpoint(auth_timeout=1.0, max_unauthenticated=3, max_connections=8) as srv:
        yield srv


class _NullConn:
    def send_bytes(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _client(srv: E.EndpointServer) -> E.GroupClient:
    return E.GroupClient(E.format_address(*srv.address), KEY, connect_timeout=10.0)


def _raw_request(srv: E.EndpointServer, payload: bytes) -> dict:
    with Client(srv.address, authkey=KEY) as conn:
        conn.send_bytes(payload)
        assert conn.poll(10), "no reply"
        return M.decode(conn.recv_bytes(), allow_nan=True)


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes `sock` (reading past the challenge); fails after `seconds`."""
    sock.settimeout(seconds)
    start = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:  # closed with our unread bytes in its buffer
        pass
    return time.monotonic() - start


def test_an_idle_unauthenticated_connection_is_dropped_after_the_handshake_timeout(server):
    sock = socket.create_connection(server.address, timeout=5)
    took = _closed_within(sock, 10)
    assert 0.8 < took < 5
    stalled = socket.create_connection(server.address, timeout=5)  # starts a message and stops in its middle
    stalled.recv(4096)  # the challenge
    stalled.sendall(struct.pack("!i", 1000) + b"x" * 10)
    assert _closed_within(stalled, 10) < 5
    assert _client(server).call(M.STATUS, timeout=10) == {"verb": "status"}
    print(f"\nendpoint: an idle unauthenticated connection was dropped after {took:.2f} s (handshake timeout 1 s)")


ANSWER = struct.pack("!i", 200) + b"x" * 200
"""A well-formed start of an answer to the challenge (its length, then bytes), to be sent one byte at a time."""


def _in_handshake(source: str, address: tuple[str, int]) -> socket.socket:
    """A connection from `source` (any 127.x address on Linux) that got its challenge and answers nothing."""
    sock = socket.create_connection(address, timeout=5, source_address=(source, 0))
    sock.recv(4096)
    return sock


def _is_open(sock: socket.socket) -> bool:
    return not select.select([sock], [], [], 0.2)[0]  # the endpoint's close makes it readable (EOF or reset)


def test_a_newcomer_past_the_cap_displaces_the_oldest_handshake(server):
    held = [_in_handshake("127.0.0.1", server.address) for _ in range(3)]
    start = time.monotonic()
    assert _client(server).call(M.STATUS, timeout=10) == {"verb": "status"}  # displacing held[0], at once
    served = time.monotonic() - start
    assert served < 0.5 and server.handshakes.displaced == 1
    assert not _is_open(held[0]) and all(_is_open(sock) for sock in held[1:])
    print(f"\nendpoint: with the 3 handshake slots held, a good client was served after {served:.3f} s")
    for sock in held:
        sock.close()


def test_one_peer_address_holds_at_most_its_share_of_the_handshakes():
    with _endpoint(max_unauthenticated=8, max_per_peer=2) as srv:
        slow = [_in_handshake("127.0.0.2", srv.address) for _ in range(4)]
        local = _in_handshake("127.0.0.1", srv.address)
        assert [_is_open(sock) for sock in slow] == [False, False, True, True] and _is_open(local)
        assert len(srv.handshakes._open) == 3 and srv.handshakes.displaced == 2
        assert _client(srv).call(M.STATUS, timeout=10) == {"verb": "status"}
        assert all(_is_open(sock) for sock in (*slow[2:], local))  # the other address's are not displaced
        for sock in (*slow, local):
            sock.close()


class _Trickle:
    """`n` connections that, after their challenge, send one byte of an answer every `every` seconds, and connect
    again at once when the endpoint drops them (past the caps, a flood); all stopped and closed by `stop`."""

    def __init__(self, address: tuple[str, int], n: int, every: float) -> None:
        self.address, self.every, self.connects = address, every, 0
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with socket.create_connection(self.address, timeout=5) as sock:
                    sock.recv(4096)  # the challenge
                    with self._lock:
                        self.connects += 1
                    for byte in ANSWER:
                        sock.sendall(bytes([byte]))
                        if self._dropped_or_stopped(sock):
                            break
            except OSError:
                self._stop.wait(0.1)

    def _dropped_or_stopped(self, sock: socket.socket) -> bool:
        """Wait `every` seconds for the endpoint to drop `sock` (it becomes readable) or `stop`."""
        end = time.monotonic() + self.every
        while not self._stop.is_set() and time.monotonic() < end:
            if select.select([sock], [], [], 0.05)[0]:
                return True
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in self._threads)


def test_slow_trickling_handshakes_do_not_keep_a_client_out():
    """8 connections sending one byte every 3 s (each byte would restart a timeout per read), connecting again when
    dropped: a good client is served within 6 s (the defaults: a 5 s deadline, 4 handshakes per address, 8 in
    all)."""
    with _endpoint() as srv:
        attack = _Trickle(srv.address, 8, every=3.0)
        try:
            deadline = time.monotonic() + 10
            while attack.connects < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert attack.connects >= 8
            start = time.monotonic()
            assert _client(srv).call(M.STATUS, timeout=10) == {"verb": "status"}
            served = time.monotonic() - start
        finally:
            attack.stop()
    assert served < 6.0
    print(f"\nendpoint: under 8 trickling handshakes (1 byte / 3 s each, {attack.connects} connections) a good "
          f"client was served after {served:.3f} s")


def test_a_trickling_handshake_is_shut_down_at_its_deadline(server):
    sock = socket.create_connection(server.address, timeout=5)
    sock.recv(4096)  # the challenge
    start = time.monotonic()
    try:
        for byte in ANSWER:
            sock.sendall(bytes([byte]))  # one byte every 0.2 s: a timeout per read would never expire
            if select.select([sock], [], [], 0.2)[0]:
                break
    except OSError:
        pass
    took = time.monotonic() - start
    sock.close()
    assert 0.7 < took < 5.0 and server.handshakes.expired == 1  # the deadline (1 s), not the trickle (40 s); loaded CI


def test_a_wrong_key_is_rejected(server):
    with pytest.raises(E.GroupUnavailable, match="rejected"):
        E.GroupClient(E.format_address(*server.address), b"x" * 32).call(M.STATUS, timeout=5)


@pytest.mark.parametrize("payload, error", [
    (b'{"version": 2, "verb": "status", "args": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested deeper"),
    (b'{"version": 2, "verb": "status", "args": {"a": ' + b"[" * 40 + b"]" * 40 + b"}}", "nested deeper than 32"),
    (b'{"version": 2, "verb": "train", "args": {"lr": NaN}}', "NaN is not accepted"),
    (b'{"version": 2, "verb": "train", "args": {"lr": -Infinity}}', "-Infinity is not accepted"),
    (b"\xff\xfe not json", "not a JSON message"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"version": 1, "verb": "status", "args": {}}', "protocol version"),
    (b'{"version": 2, "verb": "format-disk", "args": {}}', "malformed instruction"),
    (b'{"version": 2, "verb": "collect", "args": {"job": "j", "wait": "soon"}}', "'wait' must be a number"),
])
def test_malformed_requests_get_an_error_and_the_endpoint_goes_on(server, payload, error):
    reply = _raw_request(server, payload)
    assert not reply["ok"] and error in reply["error"]
    assert _client(server).call(M.STATUS, timeout=10) == {"verb": "status"}


def test_a_reply_may_carry_a_nan_but_an_instruction_may_not():
    assert M.decode(M.encode({"loss": float("nan")}), allow_nan=True)["loss"] != 0
    with pytest.raises(M.ProtocolError, match="NaN"):
        M.decode(M.encode({"loss": float("nan")}))
    with pytest.raises(ValueError):
        M.encode(M.instruction(M.TRAIN, {"lr": float("nan")}), allow_nan=False)


def test_key_files_must_be_private_to_their_owner(tmp_path):
    path = tmp_path / "k"
    path.write_text("x" * 64)
    for mode in (0o640, 0o604, 0o660, 0o620):
        os.chmod(path, mode)
        with pytest.raises(ConfigError, match=f"mode {mode:03o}.*chmod 600"):
            E.read_authkey(path)
    os.chmod(path, 0o644)
    key = E.write_authkey(path)  # an existing file is rewritten private
    assert os.stat(path).st_mode & 0o777 == 0o600 and E.read_authkey(path) == key


def test_hand_off_and_run_directories_are_fresh_and_private(tmp_path):
    fresh = [launch.fresh_private_dir("h-", tmp_path) for _ in range(2)]
    assert fresh[0] != fresh[1] and all(os.stat(d).st_mode & 0o777 == 0o700 for d in fresh)
    with pytest.raises(ConfigError, match="cannot make a private directory under .*missing"):
        launch.fresh_private_dir("h-", tmp_path / "missing")
    made = launch.private_dir(tmp_path / "new")
    assert os.stat(made).st_mode & 0o777 == 0o700
    assert launch.private_dir(made) == made  # an own private one is reused
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="not private to this user.*mode 777"):
        launch.private_dir(shared)
    readable = tmp_path / "readable"
    readable.mkdir()
    os.chmod(readable, 0o755)
    assert launch.private_dir(readable) == readable and os.stat(readable).st_mode & 0o777 == 0o700  # tightened
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(ConfigError, match="not a directory"):
        launch.private_dir(tmp_path / "link")


@pytest.mark.parametrize("address", ["0.0.0.0:7100", "10.0.0.7:7100", "node12.cluster.org:7100", "[fe80::1]:7100"])
def test_the_endpoint_listens_and_is_reached_on_loopback_only(tmp_path, address, capsys):
    """Its messages are authenticated, not encrypted: the group's rank 0 listens, and the ClientApp connects, only on
    a loopback address; anything else is refused before a socket is opened."""
    from types import SimpleNamespace

    from flwr_sharded.flower import clientapp
    from flwr_sharded.flower.group import runtime

    key_file = tmp_path / "key"
    E.write_authkey(key_file)
    host, port = E.parse_address(address)
    with pytest.raises(ConfigError, match="not a loopback address"):
        E.EndpointServer((host, port), KEY)
    with pytest.raises(ConfigError, match="not a loopback address"):
        E.GroupClient(address, KEY)
    node = SimpleNamespace(node_config={clientapp.NODE_ADDRESS: address, clientapp.NODE_AUTHKEY: str(key_file)})
    with pytest.raises(ConfigError, match=r"use 127\.0\.0\.1"):
        clientapp.find_group(node, {}, launch=False)
    assert runtime.main(["--authkey-file", str(key_file), "--address", address]) == 2
    assert f"--address {address!r} is not a loopback address" in capsys.readouterr().err
    for loopback in ("127.0.0.1:7100", "127.0.0.9:7100", "localhost:7100", "[::1]:7100"):
        assert E.GroupClient(loopback, KEY).port == 7100
