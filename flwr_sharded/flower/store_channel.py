"""The wire format of a round's rendezvous store: a challenge-response on the round's secret, then frames each carrying
an HMAC under a per-connection key; authenticated, not encrypted.

The server greets (`GREETING` + nonce); the client's hello names the scope, its nonce and HMAC(secret, "client" |
scope | nonces); a server with that scope open answers `ACCEPT` + HMAC(secret, "server" | ...), proving itself. Every
later frame is `length | payload | HMAC(session key, direction | sequence | payload)`: it cannot be altered, replayed,
reordered or moved to another connection or round. Payloads are an op or status byte and length-prefixed fields
(`pack`): nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

GREETING = b"flwr-rdv/1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
ACCEPT = b"\x01"
HELLO_MAX_BYTES = 1024
"""Largest hello frame a server reads before the client has proven the secret."""
KEY_MAX_BYTES = 4096
VALUE_MAX_BYTES = 1 << 20
"""Largest value one set may store (gloo's and NCCL's rendezvous values are under 1 KiB)."""
FRAME_MAX_BYTES = VALUE_MAX_BYTES + 2 * KEY_MAX_BYTES + 64
_LENGTH = struct.Struct("!I")
_SEQUENCE = struct.Struct("!Q")
CLIENT_TO_SERVER, SERVER_TO_CLIENT = b"c", b"s"
OK, MISSING, ERROR, CLOSED = b"+", b"-", b"!", b"x"
"""Reply statuses (CLOSED: the host ended the round)."""
SET, GET, CHECK, WAIT, ADD, COMPARE_SET, DELETE, NUM_KEYS, TURNED_AWAY = (bytes([c]) for c in b"SGCWAXDNT")
"""Operations."""


class ChannelError(RuntimeError):
    """A frame that is too large, malformed or not authenticated (the connection is closed)."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def client_proof(secret: bytes, scope: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _mac(secret, b"client", scope, server_nonce, client_nonce)


def server_proof(secret: bytes, scope: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _mac(secret, b"server", scope, server_nonce, client_nonce)


def session_key(secret: bytes, scope: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _mac(secret, b"session", scope, server_nonce, client_nonce)


def pack(head: bytes, *fields: bytes) -> bytes:
    """`head` (one op or status byte) followed by each field, length-prefixed."""
    return head + b"".join(_LENGTH.pack(len(f)) + f for f in fields)


def unpack(payload: bytes) -> tuple[bytes, list[bytes]]:
    """The head byte and the fields of a `pack`ed payload; ChannelError if it is malformed."""
    if not payload:
        raise ChannelError("empty payload")
    fields, at = [], 1
    while at < len(payload):
        if at + _LENGTH.size > len(payload):
            raise ChannelError("truncated field length")
        (size,) = _LENGTH.unpack_from(payload, at)
        at += _LENGTH.size
        if at + size > len(payload):
            raise ChannelError("truncated field")
        fields.append(payload[at:at + size])
        at += size
    return payload[:1], fields


def frame_length(header: bytes, limit: int) -> int:
    """The payload length a 4-byte frame header announces; ChannelError beyond `limit`."""
    (size,) = _LENGTH.unpack(header)
    if size > limit:
        raise ChannelError(f"a frame of {size} bytes (at most {limit})")
    return size


def plain_frame(payload: bytes) -> bytes:
    """A frame before the session key exists (the hello)."""
    return _LENGTH.pack(len(payload)) + payload


class Sealer:
    """Seals outgoing and opens incoming frames of one connection (one side's sequence numbers)."""

    def __init__(self, key: bytes, *, sending: bytes, receiving: bytes) -> None:
        self._key, self._sending, self._receiving = key, sending, receiving
        self._sent = self._received = 0

    def seal(self, payload: bytes) -> bytes:
        mac = _mac(self._key, self._sending, _SEQUENCE.pack(self._sent), payload)
        self._sent += 1
        return _LENGTH.pack(len(payload)) + payload + mac

    def open(self, payload: bytes, mac: bytes) -> bytes:
        expected = _mac(self._key, self._receiving, _SEQUENCE.pack(self._received), payload)
        if not hmac.compare_digest(mac, expected):
            raise ChannelError("a frame without a valid MAC (altered, replayed or not from this connection)")
        self._received += 1
        return payload
