"""The rendezvous store a group's rank 0 serves to the rounds it hosts: members only, bounded memory.

One thread serves, on one port per shard index, the key-value operations gloo and NCCL build a process group with. A
client reads or writes nothing before proving the round's secret (`store_channel`) for a scope the host opened
(`open_scopes`: a round's prefix and shard index, each its own key space); closing a scope drops its keys at once and
its connections `CLOSE_GRACE_S` later (answered `CLOSED` meanwhile). Strangers cost at most a hello frame on
`MAX_PENDING` connections (`MAX_PENDING_PER_HOST` per address) for `HANDSHAKE_S`; one more is turned away and counted
in every open round (a member that could not connect then is not at fault). Keys and values take at most
`STORE_MAX_BYTES`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import threading
from dataclasses import dataclass, field

from flwr_sharded.flower import store_channel

logger = logging.getLogger(__name__)

STORE_MAX_BYTES = 16 << 20
"""Keys and values of every open round together (each entry also counts ENTRY_OVERHEAD_BYTES)."""
ENTRY_OVERHEAD_BYTES = 128
MAX_SCOPES = 64
"""Open scopes (a round opens one per shard index)."""
MAX_PENDING = 64
"""Connections that have not proven a round's secret yet (a further one is turned away)."""
MAX_PENDING_PER_HOST = 8
"""The same, from one source address (one stranger's host cannot fill MAX_PENDING alone)."""
MAX_CONNECTIONS_PER_SCOPE = 1024
"""Proven connections to one scope (one per member and shard index)."""
HANDSHAKE_S = 5.0
CLOSE_GRACE_S = 30.0
"""How long a closed round's members stay connected (their requests answered CLOSED)."""
WAIT_SLICE_MAX_S = 1.0
READ_LIMIT_BYTES = 64 << 10
"""asyncio's read buffer per connection (it stops reading a socket at twice this)."""


class StoreFull(RuntimeError):
    """A write would take the store past STORE_MAX_BYTES."""


@dataclass
class _Round:
    secret: bytes
    data: dict[bytes, bytes] = field(default_factory=dict)
    used: int = 0
    turned_away: int = 0
    closed: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)


class StoreServer:
    """The rendezvous stores of one group, one listening port per shard index (any port serves every scope)."""

    def __init__(self, sockets: list[socket.socket], *, max_bytes: int = STORE_MAX_BYTES) -> None:
        self.ports = [s.getsockname()[1] for s in sockets]
        self.max_bytes, self.used, self.pending = max_bytes, 0, 0
        self._rounds: dict[bytes, _Round] = {}
        self._pending_by_host: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sockets, started), name="rendezvous-store",
                                        daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the rendezvous store did not start within 30 s")

    def _run(self, sockets: list[socket.socket], started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        listeners = []
        for sock in sockets:
            sock.setblocking(False)
            listeners.append(self._loop.run_until_complete(
                asyncio.start_server(self._serve, sock=sock, limit=READ_LIMIT_BYTES)))
        started.set()
        try:
            self._loop.run_forever()
        finally:  # close(): the ports released, every connection's task ended
            for listener in listeners:
                listener.close()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    # ----- the host's side (any thread) -----------------------------------------------------------------------
    def _call(self, fn, *args):  # noqa: ANN001, ANN202 - runs fn(*args) in the server's thread
        async def run():  # noqa: ANN202
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def open_round(self, prefix: str, secret: str, shards: int) -> None:
        """Admit the members of round `prefix` to its scopes (`round_scopes`), who prove `secret`."""
        self.open_scopes(round_scopes(prefix, shards), secret)

    def open_scopes(self, scopes: list[str], secret: str) -> None:
        """Admit the members of a round to each of `scopes`, who prove `secret`; ValueError beyond MAX_SCOPES."""
        if len(scopes) > MAX_SCOPES:
            raise ValueError(f"a round of {len(scopes)} rendezvous scopes; this store holds at most {MAX_SCOPES}")
        self._call(self._open, [scope.encode() for scope in scopes], secret.encode())

    def close_scopes(self, scopes: list[str]) -> None:
        """Drop the keys and connections of `scopes`."""
        self._call(self._close, [scope.encode() for scope in scopes])

    def close(self) -> None:
        """Stop serving (every round closed, the ports released)."""
        if self._loop.is_closed():
            return
        self._call(self._close_all)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _close_all(self) -> None:
        rounds = list(self._rounds.values())
        self._close(list(self._rounds))
        for round_ in rounds:
            self._drop_connections(round_)

    def _open(self, scopes: list[bytes], secret: bytes) -> None:
        self._close(scopes)
        while len(self._rounds) + len(scopes) > MAX_SCOPES and self._rounds:
            self._close([next(iter(self._rounds))])
        for scope in scopes:
            self._rounds[scope] = _Round(secret)

    def _close(self, scopes: list[bytes]) -> None:
        for scope in scopes:
            round_ = self._rounds.pop(scope, None)
            if round_ is None:
                continue
            self.used -= round_.used
            round_.data.clear()
            round_.used, round_.closed = 0, True
            self._loop.create_task(self._wake(round_))
            self._loop.call_later(CLOSE_GRACE_S, self._drop_connections, round_)

    async def _wake(self, round_: _Round) -> None:
        async with round_.changed:
            round_.changed.notify_all()

    @staticmethod
    def _drop_connections(round_: _Round) -> None:
        for writer in list(round_.writers):
            writer.close()

    # ----- a connection ---------------------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = peer[0] if peer else ""
        if self.pending >= MAX_PENDING or self._pending_by_host.get(host, 0) >= MAX_PENDING_PER_HOST:
            for round_ in self._rounds.values():
                round_.turned_away += 1
            writer.close()
            return
        self.pending += 1
        self._pending_by_host[host] = self._pending_by_host.get(host, 0) + 1
        try:
            try:
                admitted = await asyncio.wait_for(self._handshake(reader, writer), HANDSHAKE_S)
            finally:
                self.pending -= 1
                self._pending_by_host[host] -= 1
                if not self._pending_by_host[host]:
                    del self._pending_by_host[host]
            if admitted is not None:
                await self._session(reader, writer, *admitted)
        except (store_channel.ChannelError, OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass  # a stranger, a member gone or its round closed: the connection ends
        finally:
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> tuple[_Round, store_channel.Sealer] | None:
        server_nonce = secrets.token_bytes(store_channel.NONCE_BYTES)
        writer.write(store_channel.GREETING + server_nonce)
        await writer.drain()
        size = store_channel.frame_length(await reader.readexactly(4), store_channel.HELLO_MAX_BYTES)
        head, fields = store_channel.unpack(await reader.readexactly(size))
        if head != b"h" or len(fields) != 3 or len(fields[1]) != store_channel.NONCE_BYTES:
            return None
        scope, client_nonce, proof = fields
        round_ = self._rounds.get(scope)
        if round_ is None or len(round_.writers) >= MAX_CONNECTIONS_PER_SCOPE:
            return None
        if not hmac.compare_digest(proof, store_channel.client_proof(round_.secret, scope, server_nonce, client_nonce)):
            return None
        writer.write(store_channel.ACCEPT + store_channel.server_proof(round_.secret, scope, server_nonce,
                                                                       client_nonce))
        await writer.drain()
        key = store_channel.session_key(round_.secret, scope, server_nonce, client_nonce)
        return round_, store_channel.Sealer(key, sending=store_channel.SERVER_TO_CLIENT,
                                            receiving=store_channel.CLIENT_TO_SERVER)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, round_: _Round,
                       sealer: store_channel.Sealer) -> None:
        round_.writers.add(writer)
        try:
            while True:
                size = store_channel.frame_length(await reader.readexactly(4), store_channel.FRAME_MAX_BYTES)
                payload = await reader.readexactly(size)
                mac = await reader.readexactly(store_channel.MAC_BYTES)
                op, fields = store_channel.unpack(sealer.open(payload, mac))
                try:
                    reply = await self._op(round_, op, fields)
                except (StoreFull, ValueError, IndexError) as exc:
                    reply = store_channel.pack(store_channel.ERROR, str(exc).encode())
                writer.write(sealer.seal(reply))
                await writer.drain()
        finally:
            round_.writers.discard(writer)

    # ----- the operations -------------------------------------------------------------------------------------
    async def _op(self, round_: _Round, op: bytes, fields: list[bytes]) -> bytes:
        data = round_.data
        if op == store_channel.TURNED_AWAY:
            return store_channel.pack(store_channel.OK, str(round_.turned_away).encode())
        if round_.closed:
            return store_channel.CLOSED
        if op == store_channel.SET:
            await self._put(round_, _key(fields[0]), _value(fields[1]))
            return store_channel.OK
        if op == store_channel.GET:
            value = data.get(fields[0])
            return store_channel.MISSING if value is None else store_channel.pack(store_channel.OK, value)
        if op == store_channel.CHECK:
            return store_channel.OK if all(k in data for k in fields) else store_channel.MISSING
        if op == store_channel.WAIT:
            slice_s = min(WAIT_SLICE_MAX_S, max(0.0, int(fields[0]) / 1000))
            keys = fields[1:]
            async with round_.changed:
                try:
                    await asyncio.wait_for(round_.changed.wait_for(
                        lambda: round_.closed or all(k in data for k in keys)), slice_s)
                except asyncio.TimeoutError:
                    return store_channel.MISSING
            return store_channel.CLOSED if round_.closed else store_channel.OK
        if op == store_channel.ADD:
            value = str(int(data.get(fields[0], b"0")) + int(fields[1])).encode()
            await self._put(round_, _key(fields[0]), value)
            return store_channel.pack(store_channel.OK, value)
        if op == store_channel.COMPARE_SET:
            key, expected, desired = _key(fields[0]), fields[1], _value(fields[2])
            current = data.get(key)
            if (current is None and not expected) or current == expected:
                await self._put(round_, key, desired)
                return store_channel.pack(store_channel.OK, desired)
            return store_channel.pack(store_channel.OK, b"" if current is None else current)
        if op == store_channel.DELETE:
            return store_channel.OK if self._drop(round_, fields[0]) else store_channel.MISSING
        if op == store_channel.NUM_KEYS:
            return store_channel.pack(store_channel.OK, str(len(data)).encode())
        raise ValueError(f"unknown operation {op!r}")

    async def _put(self, round_: _Round, key: bytes, value: bytes) -> None:
        old = round_.data.get(key)
        grow = len(key) + len(value) + ENTRY_OVERHEAD_BYTES - (0 if old is None else
                                                               len(key) + len(old) + ENTRY_OVERHEAD_BYTES)
        if self.used + grow > self.max_bytes:
            raise StoreFull(f"the rendezvous store is full ({self.max_bytes} bytes)")
        round_.data[key] = value
        round_.used += grow
        self.used += grow
        async with round_.changed:
            round_.changed.notify_all()

    def _drop(self, round_: _Round, key: bytes) -> bool:
        value = round_.data.pop(key, None)
        if value is None:
            return False
        size = len(key) + len(value) + ENTRY_OVERHEAD_BYTES
        round_.used -= size
        self.used -= size
        return True


def round_scopes(prefix: str, shards: int) -> list[str]:
    """The scopes of a round whose members shard alike: one per shard index, `prefix/s<s>`."""
    return [f"{prefix}/s{s}" for s in range(shards)]


def _key(key: bytes) -> bytes:
    if len(key) > store_channel.KEY_MAX_BYTES:
        raise ValueError(f"a key of {len(key)} bytes (at most {store_channel.KEY_MAX_BYTES})")
    return key


def _value(value: bytes) -> bytes:
    if len(value) > store_channel.VALUE_MAX_BYTES:
        raise ValueError(f"a value of {len(value)} bytes (at most {store_channel.VALUE_MAX_BYTES})")
    return value
