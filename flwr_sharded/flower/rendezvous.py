"""Per-round federation process groups between Flower groups: one small group per shard index, members only,
bounded timeouts.

Each group's rank 0 hosts one persistent `TCPStore` server per shard index s (the "rendezvous offer" of its hello),
listening on exactly `--rendezvous-host` (a socket bound there, handed to the store). For a round, the ServerApp
names the members (ordered), takes member 0's offer and sends every member a fresh secret (over Flower's TLS
channel); in every member, the rank holding shard s (replica 0) joins a process group of len(members) ranks through
`SignedStore(PrefixStore(<round prefix>/s<s>, TCPStore client at host:ports[s]))`, with rank = its member index.

Members only: each member writes a proof (its node id, index and a nonce, signed with the round's secret) and waits
until every member's proof is there and names the node the ServerApp listed at that index; values without a valid
signature (a stranger writing to the store) are never counted, a proof naming another node is refused, and a member
that finds its own slot taken by another process refuses too. gloo and NCCL then exchange their addresses through the
same signed store. What is not covered: the connections gloo and NCCL open between members carry no authentication
(`docs/security.md`).

Every wait is bounded: connecting to the store and the arrivals by `rendezvous_timeout`, the backend's own rendezvous
and every collective by `sync_timeout`. Every store wait also polls `abort()`: the ServerApp's news that a member is
gone ends it at once. A group that failed is destroyed and never reused; the next round builds new ones under a new
prefix.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from flwr_sharded.errors import first_line
from flwr_sharded.flower.signed_store import SignedStore, StoreAborted

logger = logging.getLogger(__name__)


GLOO_CONNECT_ATTEMPTS = 5
"""How many times gloo retries connecting a pair, each with the group's timeout (measured: torch 2.13)."""
MIN_CONNECT_S = 10.0
"""Shortest timeout a federation group is built with (then raised to sync_timeout for its collectives)."""
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


class RendezvousError(RuntimeError):
    """The federation process group could not be formed in time (a peer is missing, late or unreachable);
    `missing`: the member indices that did not arrive, where known."""

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])


def serve_stores(host: str, count: int, ports: list[int] | None = None) -> list[dist.TCPStore]:
    """Start `count` TCPStore servers listening on `host` only (port 0: any free port); they live as long as the
    objects. (A TCPStore server given only a port listens on every interface: each gets a socket bound to `host`.)"""
    stores = []
    for s in range(count):
        sock = listening_socket(host, ports[s] if ports else 0)
        port = sock.getsockname()[1]
        stores.append(dist.TCPStore(host, port, world_size=None, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60), master_listen_fd=sock.detach()))
    return stores  # each store owns (and closes) its socket's descriptor


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (the first address `host` resolves to) and listening."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise RendezvousError(f"--rendezvous-host {host!r} does not resolve: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise RendezvousError(f"cannot listen on {host}:{port} for a rendezvous store: {exc}") from exc
    return sock


@dataclass
class FederationGroup:
    """One shard index's cross-group process group for a round."""

    pg: dist.ProcessGroup
    rank: int
    size: int
    name: str
    store: dist.Store

    backend: str = "gloo"

    def destroy(self, *, failed: bool = False) -> None:
        """Release the group; never raises (a failed group may be in any state). A failed NCCL group is aborted
        (its communicator torn down without waiting for peers that may be gone)."""
        try:
            if failed and self.backend == "nccl":
                c10d._abort_process_group(self.pg)
            else:
                dist.destroy_process_group(self.pg)
        except Exception as exc:  # noqa: BLE001 - best effort on a possibly broken group
            logger.debug("destroying %s: %s", self.name, exc)


def backend_for_device(device: torch.device, choice: str = "auto") -> str:
    """auto: NCCL for CUDA shards, gloo otherwise (gloo also reduces CUDA tensors, more slowly)."""
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


def join(*, host: str, port: int, prefix: str, rank: int, size: int, rendezvous_timeout: float,
         sync_timeout: float, secret: str, members: Sequence[str], backend: str = "gloo",
         device: torch.device | None = None, abort: Callable[[], str] | None = None) -> FederationGroup:
    """Join the federation group `prefix` of `size` members as `rank`, through the store at host:port.

    `secret` is the round's (from the ServerApp), `members` the node ids the ServerApp listed, in order; `abort()`
    returns why to stop waiting ('' to go on). Raises RendezvousError if the store cannot be reached, the other
    members do not prove themselves in time, a proof names another node or this member's slot is taken, or
    `abort()` gives a reason.
    """
    if not 0 <= rank < size or len(members) != size or len(set(members)) != size:
        raise ValueError(f"member index {rank} of {size} members {list(members)} (distinct node ids expected)")
    deadline = time.monotonic() + rendezvous_timeout
    client = _connect(host, port, prefix, deadline, rendezvous_timeout, abort)
    store = SignedStore(dist.PrefixStore(prefix, client), secret.encode(), prefix, timeout=rendezvous_timeout,
                        abort=abort)
    # Members prove themselves first: a missing one then fails here, within the rendezvous timeout, before any
    # backend (NCCL's watchdog would tear the process down on a collective timeout), and a stranger is never counted.
    _arrive(store, prefix, rank, list(members), deadline, rendezvous_timeout)
    name = f"flwr-fed:{prefix}"
    # gloo connects every pair when the group is built and retries a silent peer GLOO_CONNECT_ATTEMPTS times with the
    # group's timeout: build it with a fraction of sync_timeout (so a peer frozen mid-handshake costs about
    # sync_timeout in all, not 5x), but at least MIN_CONNECT_S (the wait for a peer's address is not retried, and a
    # loaded machine can stall a process for seconds), then give the collectives the whole sync_timeout.
    connect_s = sync_timeout
    if backend == "gloo":
        connect_s = min(sync_timeout, max(MIN_CONNECT_S, sync_timeout / GLOO_CONNECT_ATTEMPTS))
    store.set_timeout(timedelta(seconds=connect_s))
    try:
        with _nccl_errors_raise(backend):
            pg, _ = c10d._new_process_group_helper(size, rank, [], backend, store, group_name=name,
                                                   timeout=timedelta(seconds=connect_s),
                                                   group_desc="flwr_sharded federation group")
        if connect_s != sync_timeout:
            pg.set_timeout(timedelta(seconds=sync_timeout))
    except Exception as exc:
        raise RendezvousError(f"federation group {prefix}: backend {backend} rendezvous failed: "
                              f"{first_line(exc)}") from exc
    # Registered like a sub-group of this process's world, so that get_rank(group) and destroy work; the other
    # members live in other worlds, so they get global ranks of their own (negative: no rank of this world), which
    # point-to-point ops (the 8-bit ring) map back to their group ranks.
    c10d._world.pg_group_ranks[pg] = {dist.get_rank(): rank, **{-1 - j: j for j in range(size) if j != rank}}
    return FederationGroup(pg=pg, rank=rank, size=size, name=name, store=store, backend=backend)


def _connect(host: str, port: int, prefix: str, deadline: float, timeout: float,
             abort: Callable[[], str] | None) -> dist.TCPStore:
    """A client of the store at host:port, trying until `deadline` (quietly: a plain TCP connect first)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                break
        except OSError as exc:
            reason = abort() if abort is not None else ""
            if reason:
                raise RendezvousError(f"federation group {prefix}: {reason}") from exc
            if time.monotonic() >= deadline:
                raise RendezvousError(f"cannot reach the rendezvous store at {host}:{port} within {timeout:.0f} s: "
                                      f"{first_line(exc)}") from exc
            time.sleep(0.2)
    try:
        return dist.TCPStore(host, port, world_size=None, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except Exception as exc:  # DistNetworkError, DistStoreError, RuntimeError
        raise RendezvousError(f"cannot reach the rendezvous store at {host}:{port} within "
                              f"{timeout:.0f} s: {first_line(exc)}") from exc


def _arrive(store: SignedStore, prefix: str, rank: int, members: list[str], deadline: float, timeout: float) -> None:
    """Write this member's proof, then wait until every member's is there and names the listed node."""
    nonce = secrets.token_hex(16)
    store.set(f"member/{rank}", json.dumps({"node": members[rank], "rank": rank, "nonce": nonce}))
    proven: set[int] = set()
    while True:
        try:
            store.check_abort()
            for r in range(len(members)):
                if r in proven and r != rank:
                    continue
                value = store.verified(f"member/{r}")
                if value is None:
                    continue
                proof = json.loads(value)
                if not isinstance(proof, dict) or proof.get("node") != members[r] or proof.get("rank") != r:
                    proof = proof if isinstance(proof, dict) else {}
                    raise RendezvousError(f"federation group {prefix}: a proof for member index {r} names node "
                                          f"{proof.get('node')!r} (index {proof.get('rank')!r}), but the ServerApp "
                                          f"listed node {members[r]!r} there: refused")
                if r == rank and proof.get("nonce") != nonce:
                    raise RendezvousError(f"federation group {prefix}: another process holding the round's secret "
                                          f"took this member's slot (index {rank}, node {members[rank]!r}): refused")
                proven.add(r)
        except StoreAborted as exc:
            raise RendezvousError(f"federation group {prefix}: {exc}") from None
        except (RuntimeError, ValueError) as exc:  # the store went away, or a proof is not JSON
            if isinstance(exc, RendezvousError):
                raise
            raise RendezvousError(f"federation group {prefix}: rendezvous failed: {first_line(exc)}") from exc
        if len(proven) == len(members):
            return
        if time.monotonic() >= deadline:
            missing = sorted(set(range(len(members))) - proven)
            forged = sorted(int(k.rsplit("/", 1)[1]) for k in store.forged if k.startswith("member/"))
            note = (f"; values not signed with the round's secret were written for member index(es) {forged} and "
                    f"ignored (a stranger?)" if forged else "")
            raise RendezvousError(f"federation group {prefix}: member(s) {missing} did not arrive within "
                                  f"{timeout:.0f} s{note}", missing)
        time.sleep(0.05)


@contextmanager
def _nccl_errors_raise(backend: str) -> Iterator[None]:
    """Build an NCCL federation group in error-handling mode 2 (CleanUpOnly): a failed or timed-out collective
    aborts the group's communicator and raises in this rank, which rolls back, instead of the watchdog tearing the
    process down (mode 1, `deploy/env.sh`'s default for the group's own collectives). The variable is read when the
    group is constructed, so the process's other groups keep their mode."""
    if backend != "nccl":
        yield
        return
    saved = os.environ.get(NCCL_ERROR_HANDLING)
    os.environ[NCCL_ERROR_HANDLING] = "2"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[NCCL_ERROR_HANDLING]
        else:
            os.environ[NCCL_ERROR_HANDLING] = saved
