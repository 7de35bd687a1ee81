"""The local endpoint between a node's ClientApp and its group's rank 0, both ends. Torch-free.

One JSON instruction per `multiprocessing.connection` connection (never pickle), authenticated both ways with the
authkey, each connection in its own thread. The group's main loop takes instructions one at a time; `collect` and
`abort` are answered from their connection's thread, so they never queue behind the job they concern.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any, Callable, Mapping

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.messages import (ABORT, COLLECT, MAX_MESSAGE_BYTES, ProtocolError, check_instruction,
                                          decode, encode, instruction, reply_error, reply_ok)

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0
"""A connection that does not send its instruction within this time after the handshake is dropped."""
AUTH_TIMEOUT_S = 5.0
"""A connection that has not answered the challenge this long after it was accepted is shut down, however it
trickles its bytes; it also bounds every later read that makes no progress."""
SEND_TIMEOUT_S = 60.0
"""A reply that the caller does not read within this time is dropped."""
MAX_UNAUTHENTICATED = 8
"""Connections in the handshake at once; a newcomer past the cap displaces the oldest one."""
MAX_HANDSHAKES_PER_PEER = 4
"""Connections from one peer address in the handshake at once; a newcomer past the cap displaces its oldest one."""
MAX_CONNECTIONS = 64
"""Authenticated connections served at once (requests being read, collects waiting for their job)."""
KEPT_JOBS = 4
"""Finished detached jobs whose results the server keeps until collected (older ones are dropped)."""


class GroupUnavailable(RuntimeError):
    """The group cannot be reached, rejected the key, went away or did not answer in time."""


class GroupError(RuntimeError):
    """The group answered with an error."""

    def __init__(self, message: str, result: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = dict(result or {})


# ----------------------------------------------------------------------------------------- addresses and keys

def parse_address(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port); the port may be 0 (pick a free one) only where a server listens."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"address {text!r} is not host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or `localhost`."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        return False


def loopback_address(text: str, what: str = "the group endpoint's address") -> tuple[str, int]:
    """`parse_address`, refusing any host outside loopback: the endpoint's messages are authenticated but not
    encrypted, and it serves only the ClientApp on its own node."""
    host, port = parse_address(text)
    if not is_loopback(host):
        raise ConfigError(f"{what} {text!r} is not a loopback address (127.0.0.0/8, ::1): the group endpoint "
                          f"speaks plaintext and serves only the ClientApp on its own node; run the SuperNode on the "
                          f"group's rank-0 node and use 127.0.0.1 (deploy/slurm/group.sbatch does)")
    return host, port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_authkey(path: str | Path) -> bytes:
    """Create `path` (mode 0600, also if it existed) holding a fresh random key; returns the key bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key)
    return key


def read_authkey(path: str | Path) -> bytes:
    """The key in `path` (surrounding whitespace stripped); refuses a missing or empty file, and one that anyone but
    its owner may read or write (mode & 0o077)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"authkey file {path} does not exist")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(f"authkey file {path} has mode {mode:03o}: it is accessible by other users or the group; "
                          f"chmod 600 {path}")
    key = path.read_bytes().strip()
    if len(key) < 16:
        raise ConfigError(f"authkey file {path} holds {len(key)} bytes; use at least 16 (e.g. `openssl rand -hex 32`)")
    return key


def _set_io_timeouts(conn: Connection, receive_s: float, send_s: float) -> None:
    """Bound every blocking read and write on `conn`'s socket: a stalled peer raises OSError, never holds the thread."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        for option, seconds in ((socket.SO_RCVTIMEO, receive_s), (socket.SO_SNDTIMEO, send_s)):
            sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
    finally:
        sock.close()  # the duplicate only; the options belong to the socket both descriptors share


# ---------------------------------------------------------------------------------------------------- client

class GroupClient:
    """Calls one verb per connection on a group's endpoint; every wait is bounded."""

    def __init__(self, address: str, authkey: bytes, *, connect_timeout: float = 15.0) -> None:
        self.address = address
        self.host, self.port = loopback_address(address)
        self._authkey = authkey
        self.connect_timeout = connect_timeout

    def call(self, verb: str, args: Mapping[str, Any] | None = None, *, timeout: float = 600.0,
             detach: bool = False) -> dict[str, Any]:
        """Send one instruction and return the group's `result` (`detach`: the job's id, at once; see `collect`);
        GroupUnavailable (no connection, bad key, lost, no reply within `timeout` s), GroupError (an error reply)."""
        box: dict[str, Any] = {}
        request = encode(instruction(verb, args, detach=detach), allow_nan=False)

        def run() -> None:
            try:
                box["reply"] = self._exchange(request, timeout)
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        # a worker thread bounds even the stdlib client's waits without a timeout; if it hangs it is abandoned
        worker = threading.Thread(target=run, name=f"group-call-{verb}", daemon=True)
        worker.start()
        worker.join(timeout + self.connect_timeout + 5.0)
        if worker.is_alive():
            raise GroupUnavailable(f"group at {self.address}: no reply to {verb} within {timeout:.0f} s")
        if "error" in box:
            raise box["error"]
        reply = box["reply"]
        if not reply.get("ok"):
            raise GroupError(str(reply.get("error") or f"{verb} failed"), reply.get("result"))
        return dict(reply.get("result") or {})

    def collect(self, job: str, *, timeout: float) -> dict[str, Any]:
        """The result of the detached job `job`, waiting for it at most `timeout` seconds."""
        return self.call(COLLECT, {"job": job, "wait": timeout}, timeout=timeout + 5.0)

    def _exchange(self, request: bytes, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                conn = Client((self.host, self.port), family="AF_INET", authkey=self._authkey)
                break
            except ConnectionRefusedError as exc:
                if time.monotonic() > deadline:
                    raise GroupUnavailable(f"no group listens at {self.address} (connection refused)") from exc
                time.sleep(0.2)
            except (EOFError, ConnectionResetError, BrokenPipeError) as exc:  # closed in the handshake: displaced
                if time.monotonic() > deadline:
                    raise GroupUnavailable(f"the group at {self.address} closed every connection during the "
                                           f"handshake for {self.connect_timeout:.0f} s (too many connections?): "
                                           f"{exc!r}") from exc
                time.sleep(0.2)
            except (OSError, EOFError) as exc:
                raise GroupUnavailable(f"cannot connect to the group at {self.address}: {exc!r}") from exc
            except Exception as exc:  # multiprocessing.AuthenticationError
                raise GroupUnavailable(f"the group at {self.address} rejected this node's authkey: {exc}") from exc
        with conn:
            try:
                conn.send_bytes(request)
                if not conn.poll(timeout):
                    raise GroupUnavailable(f"group at {self.address}: no reply within {timeout:.0f} s")
                return decode(conn.recv_bytes(MAX_MESSAGE_BYTES), allow_nan=True)  # a loss may be NaN
            except (EOFError, OSError) as exc:
                raise GroupUnavailable(f"lost the connection to the group at {self.address} (did the group "
                                       f"die?): {exc!r}") from exc


# ---------------------------------------------------------------------------------------------------- server

class Request:
    """One authenticated connection's instruction, waiting for the main loop."""

    def __init__(self, conn: Connection, verb: str, args: dict[str, Any], detach: bool) -> None:
        self.conn, self.verb, self.args, self.detach = conn, verb, args, detach

    def reply(self, reply: Mapping[str, Any]) -> None:
        try:
            self.conn.send_bytes(encode(reply))
        except OSError as exc:
            logger.warning("could not deliver the %s reply (caller gone?): %s", self.verb, exc)
        finally:
            self.conn.close()


class Handshakes:
    """The connections whose caller has not proven the key yet, each shut down `timeout` after it was accepted, at
    most `per_peer` from one address and `total` in all. A newcomer past a cap displaces the oldest handshake it
    competes with: a legitimate one takes milliseconds, so slow connections cannot keep a client out."""

    def __init__(self, timeout: float, total: int, per_peer: int) -> None:
        self.timeout, self.total, self.per_peer = timeout, total, per_peer
        self.expired = 0
        """Handshakes shut down at their deadline."""
        self.displaced = 0
        """Handshakes shut down for a newcomer past a cap."""
        self._open: dict[int, tuple[str, float, socket.socket]] = {}
        """ticket -> (peer address, deadline, socket), oldest first."""
        self._tickets = 0
        self._changed = threading.Condition()
        self._closed = False
        threading.Thread(target=self._watch, name="endpoint-handshakes", daemon=True).start()

    def admit(self, conn: Connection) -> int:
        """Register the just-accepted `conn` (displacing the oldest handshake past a cap); its ticket for `done`."""
        sock = socket.socket(fileno=os.dup(conn.fileno()))  # its own descriptor: shut down safely at any time
        try:
            peer = str(sock.getpeername()[0])
        except OSError:
            peer = ""
        with self._changed:
            same = [t for t, (p, _, _) in self._open.items() if p == peer]
            if len(same) >= self.per_peer:
                self._shut(same[0])
                self.displaced += 1
            elif len(self._open) >= self.total:
                self._shut(next(iter(self._open)))
                self.displaced += 1
            self._tickets += 1
            self._open[self._tickets] = (peer, time.monotonic() + self.timeout, sock)
            self._changed.notify()
            return self._tickets

    def done(self, ticket: int) -> None:
        """The handshake of `ticket` is over (either way): it is no longer shut down at its deadline."""
        with self._changed:
            entry = self._open.pop(ticket, None)
        if entry is not None:
            entry[2].close()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            for ticket in list(self._open):
                self._shut(ticket)
            self._changed.notify()

    def _shut(self, ticket: int) -> None:
        """Shut the handshake's socket down (its thread's read ends at once) and forget it; holding the lock."""
        sock = self._open.pop(ticket)[2]
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the caller closed it already
        sock.close()

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                now = time.monotonic()
                while self._open and next(iter(self._open.values()))[1] <= now:  # deadlines in accepted order
                    self.expired += 1  # counted before its peer can see the shutdown
                    self._shut(next(iter(self._open)))
                wait = next(iter(self._open.values()))[1] - now if self._open else 60.0
                self._changed.wait(max(wait, 0.01))


class EndpointServer:
    """Rank 0's endpoint: authenticated instructions arrive on `incoming`; `collect` and `abort` are answered here.
    Hostile or broken callers cost a bounded amount: `auth_timeout` and the caps of `Handshakes` before the key is
    proven, `max_connections` after it (more are answered with an error at once); a malformed instruction is answered
    with an error without reaching the main loop."""

    def __init__(self, address: tuple[str, int], authkey: bytes, *, auth_timeout: float = AUTH_TIMEOUT_S,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED, max_per_peer: int = MAX_HANDSHAKES_PER_PEER,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        loopback_address(format_address(*address))
        self._authkey = authkey
        self.auth_timeout = auth_timeout
        self.handshakes = Handshakes(auth_timeout, max_unauthenticated, max_per_peer)
        self._connections = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        """Authenticated connections answered with an error because `max_connections` were being served."""
        self.listener = Listener(address, family="AF_INET", backlog=64)  # the challenge runs per connection
        self.address = self.listener.address
        self.incoming: queue.Queue[Request] = queue.Queue()
        self.last_request = 0.0
        """`time.monotonic()` of the last well-formed instruction (any verb, including those answered here)."""
        self.on_abort: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        """Answers `abort` in the connection's thread (set by the group runtime)."""
        self._closed = False
        self._jobs: dict[str, dict[str, Any] | None] = {}
        self._done = threading.Condition()
        threading.Thread(target=self._accept_loop, name="endpoint-accept", daemon=True).start()

    # ----- detached jobs ------------------------------------------------------------------------------------
    def job_started(self, job: str) -> None:
        with self._done:
            self._jobs[job] = None
            while len(self._jobs) > KEPT_JOBS:
                del self._jobs[next(iter(self._jobs))]

    def job_finished(self, job: str, reply: dict[str, Any]) -> None:
        with self._done:
            if job in self._jobs:
                self._jobs[job] = reply
            self._done.notify_all()

    def _collect(self, args: Mapping[str, Any]) -> dict[str, Any]:
        try:
            job, wait = str(args.get("job", "")), float(args.get("wait", 0.0))
        except (TypeError, ValueError):
            return reply_error(f"collect: 'wait' must be a number of seconds, got {args.get('wait')!r}")
        deadline = time.monotonic() + wait
        with self._done:
            while True:
                if job not in self._jobs:
                    return reply_error(f"no job {job!r} on this group (it was never started here, or the group "
                                       f"restarted)")
                if self._jobs[job] is not None:
                    return self._jobs[job]  # type: ignore[return-value]
                left = deadline - time.monotonic()
                if left <= 0:
                    return reply_error(f"job {job!r} did not finish within {wait:.0f} s", {"pending": True})
                self._done.wait(min(left, 1.0))

    # ----- connections --------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            try:
                ticket = self.handshakes.admit(conn)
            except OSError:  # out of descriptors
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, ticket), name="endpoint-conn", daemon=True).start()

    def _serve(self, conn: Connection, ticket: int) -> None:
        try:
            _set_io_timeouts(conn, self.auth_timeout, SEND_TIMEOUT_S)
            try:
                deliver_challenge(conn, self._authkey)  # the caller proves it holds the key ...
            finally:
                self.handshakes.done(ticket)  # ... and is no longer shut down at the deadline or displaced
            answer_challenge(conn, self._authkey)  # this end proves it (each read bounded by auth_timeout)
        except Exception as exc:  # AuthenticationError, EOFError, OSError (shut down at its deadline or displaced)
            logger.warning("rejected a connection to the group endpoint: %s", type(exc).__name__)
            conn.close()
            return
        if not self._connections.acquire(blocking=False):
            Request(conn, "", {}, False).reply(reply_error("too many connections to this group's endpoint"))
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                logger.warning("answered a connection to the group endpoint with 'too many connections' (%d so far)",
                               self.refused)
            return
        try:
            self._handle(conn)
        except Exception:  # noqa: BLE001 - never lose the thread's connection or the endpoint to one request
            logger.exception("endpoint: unexpected error while serving a request")
            conn.close()
        finally:
            self._connections.release()

    def _handle(self, conn: Connection) -> None:
        try:
            if not conn.poll(REQUEST_TIMEOUT_S):
                conn.close()
                return
            obj = decode(conn.recv_bytes(MAX_MESSAGE_BYTES))
            verb, args = check_instruction(obj)
        except (EOFError, OSError, ProtocolError) as exc:
            logger.warning("bad request on the endpoint: %s", str(exc)[:200])
            Request(conn, "", {}, False).reply(reply_error(f"bad request: {str(exc)[:200]}"))
            return
        self.last_request = time.monotonic()
        request = Request(conn, verb, args, bool(obj.get("detach", False)))
        if verb == COLLECT:
            request.reply(self._collect(args))
        elif verb == ABORT:
            request.reply(self._abort(args))
        else:
            self.incoming.put(request)

    def _abort(self, args: Mapping[str, Any]) -> dict[str, Any]:
        if self.on_abort is None:
            return reply_error("this endpoint takes no abort")
        try:
            return reply_ok(self.on_abort(dict(args)))
        except Exception as exc:  # noqa: BLE001 - reported to the caller; the group goes on
            return reply_error(f"abort failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.close()
        except OSError:
            pass
        self.handshakes.close()
