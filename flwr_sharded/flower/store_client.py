"""A member's client of a round's rendezvous store (`store_server`): the c10d Store (the whole interface) gloo and NCCL
build their process group through. `RoundStore.connect` retries until its deadline (port closed, round not open yet),
proves the round's secret for its scope and checks the server's proof; every later frame is authenticated
(`store_channel`). Every wait is bounded by the store's timeout, in server-side slices of at most `WAIT_SLICE_S`
between which it polls `abort()` (the ServerApp's news that a member is gone).
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from flwr_sharded.flower import store_channel

WAIT_SLICE_S = 0.2
"""Longest one wait on the server lasts before the client looks at `abort()` and its deadline again."""
ABORT_POLL_S = 0.2
"""Seconds between two calls of `abort()` while waiting."""
REPLY_TIMEOUT_S = 10.0
"""How long a reply may take (the server answers at once, or after one wait slice)."""
RETRY_S = 0.2


class StoreAborted(RuntimeError):
    """A wait ended early: `abort()` gave a reason (a member is gone)."""


class RoundClosed(RuntimeError):
    """The round's host ended the round (its keys are gone)."""


class StoreUnreachable(RuntimeError):
    """No connection to the round's store was admitted before the deadline."""


class RoundStore(dist.Store):
    """An authenticated connection to one round's scope of a `StoreServer`."""

    def __init__(self, sock: socket.socket, sealer: store_channel.Sealer, *, timeout: float,
                 abort: Callable[[], str] | None = None) -> None:
        super().__init__()
        self._sock, self._sealer, self._lock = sock, sealer, threading.Lock()
        self._timeout_s = float(timeout)
        self._abort = abort
        self._next_abort_check = 0.0

    @classmethod
    def connect(cls, host: str, port: int, scope: str, secret: bytes, *, deadline: float, timeout: float,
                abort: Callable[[], str] | None = None) -> RoundStore:
        """Connect and prove `secret` for `scope`, retrying until `deadline` (monotonic); StoreUnreachable then,
        StoreAborted if `abort()` gives a reason first."""
        if len(secret) < 16:
            raise ValueError("a round's secret must hold at least 16 bytes")
        store: RoundStore | None = None
        while store is None:
            try:
                sock, sealer = _admitted(host, port, scope.encode(), secret,
                                         max(0.1, min(2.0, deadline - time.monotonic())))
                store = cls(sock, sealer, timeout=timeout, abort=abort)
            except (OSError, store_channel.ChannelError) as exc:
                reason = abort() if abort is not None else ""
                if reason:
                    raise StoreAborted(reason) from None
                if time.monotonic() >= deadline:
                    raise StoreUnreachable(str(exc) or type(exc).__name__) from exc
                time.sleep(RETRY_S)
        return store

    # ----- requests -------------------------------------------------------------------------------------------
    def _request(self, op: bytes, *fields: bytes) -> tuple[bytes, list[bytes]]:
        with self._lock:
            self._sock.sendall(self._sealer.seal(store_channel.pack(op, *fields)))
            size = store_channel.frame_length(_read(self._sock, 4), store_channel.FRAME_MAX_BYTES)
            payload = _read(self._sock, size)
            status, out = store_channel.unpack(self._sealer.open(payload, _read(self._sock, store_channel.MAC_BYTES)))
        if status == store_channel.CLOSED:
            raise RoundClosed("the round's host ended the round")
        if status == store_channel.ERROR:
            raise RuntimeError(f"rendezvous store: {out[0].decode(errors='replace') if out else 'error'}")
        return status, out

    def peek(self, key: str) -> bytes | None:
        """The value of `key`, or None if it is not there (never waits)."""
        status, out = self._request(store_channel.GET, key.encode())
        return out[0] if status == store_channel.OK else None

    def turned_away(self) -> int:
        """How many connections the server turned away (too many unproven ones) since the round opened."""
        return int(self._request(store_channel.TURNED_AWAY)[1][0])

    def check_abort(self) -> None:
        """Raise StoreAborted if `abort()` gives a reason (called at most every ABORT_POLL_S)."""
        now = time.monotonic()
        if self._abort is None or now < self._next_abort_check:
            return
        self._next_abort_check = now + ABORT_POLL_S
        reason = self._abort()
        if reason:
            raise StoreAborted(reason)

    def wait_slice(self, keys: Sequence[str], seconds: float) -> bool:
        """Wait on the server up to `seconds` (at most WAIT_SLICE_S) for every key; True if they are all there."""
        millis = str(int(1000 * max(0.0, min(WAIT_SLICE_S, seconds)))).encode()
        return self._request(store_channel.WAIT, millis, *(k.encode() for k in keys))[0] == store_channel.OK

    def close(self) -> None:
        self._sock.close()

    # ----- the Store interface --------------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._request(store_channel.SET, key.encode(), _bytes(value))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while True:
            value = self.peek(key)
            if value is not None:
                return value
            self._wait_until([key], deadline)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._wait_until(keys, time.monotonic() + seconds)

    def check(self, keys: Sequence[str]) -> bool:
        return self._request(store_channel.CHECK, *(k.encode() for k in keys))[0] == store_channel.OK

    def add(self, key: str, amount: int) -> int:
        return int(self._request(store_channel.ADD, key.encode(), str(int(amount)).encode())[1][0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._request(store_channel.COMPARE_SET, key.encode(), _bytes(expected), _bytes(desired))[1][0]

    def delete_key(self, key: str) -> bool:
        return self._request(store_channel.DELETE, key.encode())[0] == store_channel.OK

    def num_keys(self) -> int:
        return int(self._request(store_channel.NUM_KEYS)[1][0])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def _wait_until(self, keys: Sequence[str], deadline: float) -> None:
        while True:
            self.check_abort()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"store keys {list(keys)} did not appear in time")
            if self.wait_slice(keys, remaining):
                return


def _admitted(host: str, port: int, scope: bytes, secret: bytes,
              timeout: float) -> tuple[socket.socket, store_channel.Sealer]:
    """A connection to host:port that proved `secret` for `scope` and received the server's proof."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        greeting = _read(sock, len(store_channel.GREETING) + store_channel.NONCE_BYTES)
        if not greeting.startswith(store_channel.GREETING):
            raise store_channel.ChannelError(f"{host}:{port} is not a rendezvous store")
        server_nonce = greeting[len(store_channel.GREETING):]
        client_nonce = secrets.token_bytes(store_channel.NONCE_BYTES)
        proof = store_channel.client_proof(secret, scope, server_nonce, client_nonce)
        sock.sendall(store_channel.plain_frame(store_channel.pack(b"h", scope, client_nonce, proof)))
        try:
            answer = _read(sock, 1 + store_channel.MAC_BYTES)
        except ConnectionError as exc:
            raise store_channel.ChannelError("the store refused this member (the round is not open there yet, or "
                                             "its secret differs)") from exc
        expected = store_channel.server_proof(secret, scope, server_nonce, client_nonce)
        if answer[:1] != store_channel.ACCEPT or not secrets.compare_digest(answer[1:], expected):
            raise store_channel.ChannelError(f"{host}:{port} did not prove the round's secret (not the round's host)")
        sock.settimeout(REPLY_TIMEOUT_S)
        key = store_channel.session_key(secret, scope, server_nonce, client_nonce)
        sealer = store_channel.Sealer(key, sending=store_channel.CLIENT_TO_SERVER,
                                      receiving=store_channel.SERVER_TO_CLIENT)
        return sock, sealer
    except BaseException:
        sock.close()
        raise


def _read(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the rendezvous store closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
