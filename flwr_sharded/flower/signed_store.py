"""A c10d Store whose every value is authenticated with a round's secret: strangers can write, not forge.

A round's rendezvous store (a TCPStore on member 0) accepts any client that reaches its port, and TCPStore has no
access control. `SignedStore` wraps the round's key space: `set` stores HMAC-SHA256(secret, scope | key | value)
in front of the value, and `get`/`wait` treat a value without the right tag as absent (until a good one appears or
the wait runs out). gloo and NCCL build their process group through this store (their peers' addresses, NCCL's
unique id), so a stranger who reaches the port can overwrite keys - which makes the round fail, like a dropped
packet - but cannot put its own address or id in a member's place. The tag binds the key and the scope (the round's
prefix), so a value cannot be replayed under another key or in another round. Values are authenticated, not
encrypted; the connections gloo and NCCL then open between the members are not authenticated at all
(`docs/security.md`).

Every wait polls, so a caller-supplied `abort()` (the ServerApp's news that a member is gone) ends it early.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

TAG_BYTES = 32
POLL_S = 0.02
"""Seconds between two looks at the store while waiting."""
ABORT_POLL_S = 0.2
"""Seconds between two calls of `abort()` while waiting."""


class StoreAborted(RuntimeError):
    """A wait ended early: `abort()` gave a reason (a member is gone)."""


class ForgedValue(RuntimeError):
    """A key held a value that was not signed with the round's secret until the wait ran out."""


class SignedStore(dist.Store):
    """`inner` with every value signed and checked; see the module docstring."""

    def __init__(self, inner: dist.Store, secret: bytes, scope: str, *, timeout: float,
                 abort: Callable[[], str] | None = None) -> None:
        super().__init__()
        if len(secret) < 16:
            raise ValueError("a round's secret must hold at least 16 bytes")
        self.inner, self._secret, self.scope = inner, secret, scope.encode()
        self._timeout_s = float(timeout)
        self._abort = abort
        self._next_abort_check = 0.0
        self.forged: set[str] = set()
        """Keys seen holding a value without a valid tag (a stranger wrote to the store)."""

    # ----- signing ------------------------------------------------------------------------------------------
    def _tag(self, key: str, value: bytes) -> bytes:
        message = b"%s\0%s\0%s" % (self.scope, key.encode(), value)
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def verified(self, key: str) -> bytes | None:
        """The value of `key` if it is there and signed with the round's secret, else None (never blocks)."""
        if not self.inner.check([key]):
            return None
        raw = bytes(self.inner.get(key))
        value = raw[TAG_BYTES:]
        if len(raw) < TAG_BYTES or not hmac.compare_digest(raw[:TAG_BYTES], self._tag(key, value)):
            self.forged.add(key)
            return None
        return value

    def check_abort(self) -> None:
        """Raise StoreAborted if `abort()` gives a reason (called at most every ABORT_POLL_S)."""
        now = time.monotonic()
        if self._abort is None or now < self._next_abort_check:
            return
        self._next_abort_check = now + ABORT_POLL_S
        reason = self._abort()
        if reason:
            raise StoreAborted(reason)

    # ----- the Store interface (what gloo and NCCL call) ----------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, self._tag(key, data) + data)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while True:
            value = self.verified(key)
            if value is not None:
                return value
            self._sleep_or_raise(deadline, [key])

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + seconds
        while not all(self.verified(k) is not None for k in keys):
            self._sleep_or_raise(deadline, keys)

    def check(self, keys: Sequence[str]) -> bool:
        return all(self.verified(k) is not None for k in keys)

    def add(self, key: str, amount: int) -> int:
        """Counters cannot be signed (the server adds); nothing the federation groups build relies on them."""
        return int(self.inner.add(key, amount))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def _sleep_or_raise(self, deadline: float, keys: Sequence[str]) -> None:
        self.check_abort()
        if time.monotonic() >= deadline:
            forged = [k for k in keys if k in self.forged]
            if forged:
                raise ForgedValue(f"store keys {forged} hold values not signed with the round's secret (a stranger "
                                  f"wrote to the rendezvous store?)")
            raise TimeoutError(f"store keys {list(keys)} did not appear in time")
        time.sleep(POLL_S)
