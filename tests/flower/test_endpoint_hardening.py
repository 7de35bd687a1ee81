"""A hostile or broken client on the group endpoint costs a bounded amount and never the endpoint: handshake
timeout, connection caps, malformed, deeply nested and NaN-bearing JSON answered with an error; key files and
hand-off directories private to their owner. In-process `EndpointServer` with a stand-in main loop (no torch)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from multiprocessing.connection import Client

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import endpoint as E
from flwr_sharded.flower import handoff
from flwr_sharded.flower import messages as M

KEY = b"k" * 32


@pytest.fixture
def server():
    """An endpoint whose main loop answers every instruction with {"verb": ...} (auth timeout 1 s, 3 handshakes)."""
    srv = E.EndpointServer(("127.0.0.1", 0), KEY, auth_timeout=1.0, max_unauthenticated=3, max_connections=8)

    def main_loop() -> None:
        while True:
            request = srv.incoming.get()
            if request.verb == M.SHUTDOWN:
                request.reply(M.reply_ok())
                return
            request.reply(M.reply_ok({"verb": request.verb}))

    thread = threading.Thread(target=main_loop, daemon=True)
    thread.start()
    yield srv
    srv.incoming.put(E.Request(_NullConn(), M.SHUTDOWN, {}, False))
    thread.join(5)
    srv.close()


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


def test_connections_beyond_the_cap_are_closed_at_once_and_the_endpoint_serves_again(server):
    held = [socket.create_connection(server.address, timeout=5) for _ in range(3)]
    for sock in held:
        sock.recv(4096)  # each got its challenge, and sits in the handshake
    extra = socket.create_connection(server.address, timeout=5)
    closed = _closed_within(extra, 5)
    assert closed < 0.5 and server.refused >= 1
    start = time.monotonic()
    assert _client(server).call(M.STATUS, timeout=10) == {"verb": "status"}  # once the idle ones are dropped
    served = time.monotonic() - start
    assert served < 8
    print(f"\nendpoint: with the 3 handshake slots held, another connection was closed after {closed:.3f} s; a "
          f"good client was served {served:.2f} s later (handshake timeout 1 s)")
    for sock in held:
        sock.close()


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
    fresh = [handoff.fresh_private_dir("h-", tmp_path) for _ in range(2)]
    assert fresh[0] != fresh[1] and all(os.stat(d).st_mode & 0o777 == 0o700 for d in fresh)
    with pytest.raises(ConfigError, match="cannot make a private directory under .*missing"):
        handoff.fresh_private_dir("h-", tmp_path / "missing")
    made = handoff.private_dir(tmp_path / "new")
    assert os.stat(made).st_mode & 0o777 == 0o700
    assert handoff.private_dir(made) == made  # an own private one is reused
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="not private to this user.*mode 777"):
        handoff.private_dir(shared)
    readable = tmp_path / "readable"
    readable.mkdir()
    os.chmod(readable, 0o755)
    assert handoff.private_dir(readable) == readable and os.stat(readable).st_mode & 0o777 == 0o700  # tightened
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(ConfigError, match="not a directory"):
        handoff.private_dir(tmp_path / "link")
