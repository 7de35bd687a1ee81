"""Per-round federation process groups between Flower groups: one per shard index, members only, every wait bounded.

Each group's rank 0 serves one store port per shard index (`store_server`, offered in its hello); member 0's opens a
round's scopes with the fresh secret the ServerApp sends every member. Each member's rank holding shard s (replica 0)
proves it at member 0's port s (scope `<round prefix>/s<s>`, `store_client.RoundStore`), writes a proof naming its
node and waits for every member's; gloo or NCCL then build the group through that store (their own connections are
unauthenticated: docs/security.md); an NCCL group is built directly over that store, its communicator made at once
(`nccl_group`), never split from this process's own groups. A failed group is destroyed (NCCL: aborted), never
reused; the NCCL variables it relies on (error-handling mode 2) are set once, when the group's process starts
(`flwr_sharded.parallel.collectives.configure_nccl_watchdog`). Store and arrivals wait at most
`rendezvous_timeout` (ended by `abort()`: a member is gone), the backend's rendezvous and collectives `sync_timeout`.
A member is named missing only if the store turned nobody away meanwhile (a stranger flooding the port is nobody's
fault).
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from flwr_sharded.errors import first_line
from flwr_sharded.parallel.collectives import group_options, nccl_class
from flwr_sharded.parallel.sites import SiteGroups, SiteLayout
from flwr_sharded.parallel.torch_compat import destroy_group, register_pg_in_world, set_timeout
from flwr_sharded.flower.store_client import RoundClosed, RoundStore, StoreAborted, StoreUnreachable
from flwr_sharded.flower.store_server import StoreServer

logger = logging.getLogger(__name__)


GLOO_CONNECT_ATTEMPTS = 5
"""How many times gloo retries connecting a pair, each with the group's timeout (measured: torch 2.13)."""
MIN_CONNECT_S = 10.0
"""Shortest timeout a federation group is built with (then raised to sync_timeout for its collectives)."""
GROUP_DESC = "flwr_sharded federation group"


class RendezvousError(RuntimeError):
    """The federation process group could not be formed in time (a peer is missing, late or unreachable);
    `missing`: the member indices that did not arrive, where known."""

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])


def serve_stores(host: str, count: int, ports: list[int] | None = None) -> StoreServer:
    """Serve `count` rendezvous store ports on `host` only (port 0: any free port), until `close()`."""
    return StoreServer([listening_socket(host, ports[s] if ports else 0) for s in range(count)])


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
    store: RoundStore | None

    backend: str = "gloo"

    def destroy(self, *, failed: bool = False) -> None:
        """Release the group; never raises (a failed group may be in any state). A failed NCCL group is aborted
        (its communicator torn down without waiting for peers that may be gone)."""
        try:
            if failed and self.backend == "nccl":
                c10d._abort_process_group(self.pg)
            else:
                destroy_group(self.pg)
        except Exception as exc:  # noqa: BLE001 - best effort on a possibly broken group
            logger.debug("destroying %s: %s", self.name, exc)
        if self.store is not None:
            self.store.close()


def backend_for_device(device: torch.device, choice: str = "auto") -> str:
    """auto: NCCL for CUDA shards, gloo otherwise (gloo also reduces CUDA tensors, more slowly)."""
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


def join(*, host: str, port: int, prefix: str, rank: int, size: int, rendezvous_timeout: float,
         sync_timeout: float, secret: str, members: Sequence[str], backend: str = "gloo",
         device: torch.device | None = None, abort: Callable[[], str] | None = None) -> FederationGroup:
    """Join federation group `prefix` of `size` members (the node ids the ServerApp listed) as `rank`, through the
    store at host:port with the round's `secret`; `abort()` says why to stop waiting. RendezvousError if the store is
    unreachable, a member does not prove itself in time, a proof names another node, this member's slot is taken, or
    `abort()` gives a reason."""
    if not 0 <= rank < size or len(members) != size or len(set(members)) != size:
        raise ValueError(f"member index {rank} of {size} members {list(members)} (distinct node ids expected)")
    deadline = time.monotonic() + rendezvous_timeout
    store = _connect(host, port, prefix, secret, deadline, rendezvous_timeout, abort)
    # members prove themselves first, so a missing one fails here, before a backend's watchdog could kill the process
    try:
        _arrive(store, prefix, rank, list(members), deadline, rendezvous_timeout)
    except BaseException:
        store.close()
        raise
    name = f"flwr-fed:{prefix}"
    try:
        pg = _process_group(store, rank, size, name, backend, sync_timeout, device)
    except Exception as exc:
        store.close()
        raise RendezvousError(f"federation group {prefix}: backend {backend} rendezvous failed: "
                              f"{first_line(exc)}") from exc
    return FederationGroup(pg=pg, rank=rank, size=size, name=name, store=store, backend=backend)


def _process_group(store: dist.Store, rank: int, size: int, name: str, backend: str, sync_timeout: float,
                   device: torch.device | None) -> dist.ProcessGroup:
    """A gloo or NCCL group of `size` members over `store`, registered like a sub-group of this world."""
    # gloo retries a silent peer GLOO_CONNECT_ATTEMPTS times with the group's timeout: build it with a share of
    # sync_timeout (at least MIN_CONNECT_S), then give the collectives the whole sync_timeout
    connect_s = sync_timeout
    if backend == "gloo":
        connect_s = min(sync_timeout, max(MIN_CONNECT_S, sync_timeout / GLOO_CONNECT_ATTEMPTS))
    store.set_timeout(timedelta(seconds=connect_s))
    if backend == "nccl":
        pg = nccl_group(store, rank, size, name, timedelta(seconds=connect_s), device)
    else:
        pg, _ = c10d._new_process_group_helper(size, rank, [], backend, store, group_name=name,
                                               timeout=timedelta(seconds=connect_s), group_desc=GROUP_DESC)
    if connect_s != sync_timeout:
        set_timeout(pg, timedelta(seconds=sync_timeout))
    # the other members get negative global ranks, which point-to-point ops (the 8-bit ring) map back to their
    # group ranks
    c10d._world.pg_group_ranks[pg] = {dist.get_rank(): rank, **{-1 - j: j for j in range(size) if j != rank}}
    return pg


def store_site_groups(group: FederationGroup, layout: SiteLayout, sync_timeout: float,
                device: torch.device | None = None) -> tuple[SiteGroups, list[FederationGroup]]:
    """The two-level reduction's groups of this member of `group` (`layout`: the site of each member, a two-level
    one): its site's members and the members holding its share at every site, built over `group`'s store (only
    their members take part). Returns them, and the groups to destroy with `group`."""
    if group.store is None:
        raise ValueError(f"{group.name} has no store to build its site groups over")
    site, j = layout.position(group.rank)
    made = []
    for key, members in ((f"site{site}", layout.members_of(site)), (f"share{j}", layout.across(j))):
        name = f"{group.name}/{key}"
        try:
            pg = _process_group(dist.PrefixStore(f"{key}/", group.store), members.index(group.rank), len(members),
                                name, group.backend, sync_timeout, device)
        except Exception as exc:
            for g in made:
                g.destroy(failed=True)
            raise RendezvousError(f"{name}: backend {group.backend} rendezvous failed: {first_line(exc)}") from exc
        made.append(FederationGroup(pg=pg, rank=members.index(group.rank), size=len(members), name=name, store=None,
                                    backend=group.backend))
    return SiteGroups(flat=group.pg, site=made[0].pg, across=made[1].pg, layout=layout), made


def _connect(host: str, port: int, prefix: str, secret: str, deadline: float, timeout: float,
             abort: Callable[[], str] | None) -> RoundStore:
    """The round's store at host:port, admitted with the round's secret (trying until `deadline`)."""
    try:
        return RoundStore.connect(host, port, prefix, secret.encode(), deadline=deadline, timeout=timeout,
                                  abort=abort)
    except StoreAborted as exc:
        raise RendezvousError(f"federation group {prefix}: {exc}") from None
    except StoreUnreachable as exc:
        raise RendezvousError(f"cannot reach the rendezvous store at {host}:{port} within {timeout:.0f} s: "
                              f"{first_line(exc)}") from exc


def _arrive(store: RoundStore, prefix: str, rank: int, members: list[str], deadline: float, timeout: float) -> None:
    """Write this member's proof, then wait until every member's is there and names the listed node."""
    try:
        proven, ended = _gather_proofs(store, prefix, rank, members, deadline)
        if len(proven) == len(members):
            return
        turned_away = store.turned_away()
    except StoreAborted as exc:
        raise RendezvousError(f"federation group {prefix}: {exc}") from None
    except (RuntimeError, OSError, ValueError) as exc:  # the store went away, or a proof is not JSON
        if isinstance(exc, RendezvousError):
            raise
        raise RendezvousError(f"federation group {prefix}: rendezvous failed: {first_line(exc)}") from exc
    # member 0 ended the round (its wait ran out first): whoever had not arrived by then is missing, not member 0
    missing = sorted(set(range(len(members))) - proven - {rank} - ({0} if ended else set()))
    if turned_away:  # a member may have been kept out by a stranger holding the store's connections: no fault
        raise RendezvousError(f"federation group {prefix}: member(s) {missing} did not arrive within {timeout:.0f} s, "
                              f"while the store turned {turned_away} connection(s) away (a stranger flooding it?): "
                              f"nobody is held at fault")
    raise RendezvousError(f"federation group {prefix}: member(s) {missing} did not arrive within {timeout:.0f} s"
                          f"{' (member 0 ended the round)' if ended else ''}", missing)


def _gather_proofs(store: RoundStore, prefix: str, rank: int, members: list[str],
                   deadline: float) -> tuple[set[int], bool]:
    """The member indices proven by `deadline` (all of them: at once), and whether member 0 ended the round first."""
    nonce = secrets.token_hex(16)
    keys = [f"member/{r}" for r in range(len(members))]
    proven: set[int] = set()
    try:
        store.set(keys[rank], json.dumps({"node": members[rank], "rank": rank, "nonce": nonce}))
        while time.monotonic() < deadline:
            store.check_abort()
            everyone = store.wait_slice(keys, deadline - time.monotonic())
            for r in range(len(members)):
                value = store.peek(keys[r]) if r not in proven or r == rank else None  # own slot: every time
                if value is not None:
                    _check_proof(json.loads(value), prefix, r, members, nonce if r == rank else None)
                    proven.add(r)
            if everyone and len(proven) == len(members):
                break
    except RoundClosed:
        return proven, True
    return proven, False


def _check_proof(proof: object, prefix: str, r: int, members: list[str], nonce: str | None) -> None:
    """Refuse a proof for member index r that names another node, or (`nonce`: this member's own slot) that this
    member did not write."""
    if not isinstance(proof, dict) or proof.get("node") != members[r] or proof.get("rank") != r:
        proof = proof if isinstance(proof, dict) else {}
        raise RendezvousError(f"federation group {prefix}: a proof for member index {r} names node "
                              f"{proof.get('node')!r} (index {proof.get('rank')!r}), but the ServerApp "
                              f"listed node {members[r]!r} there: refused")
    if nonce is not None and proof.get("nonce") != nonce:
        raise RendezvousError(f"federation group {prefix}: another process holding the round's secret "
                              f"took this member's slot (index {r}, node {members[r]!r}): refused")


def nccl_group(store: dist.Store, rank: int, size: int, name: str, timeout: timedelta,
               device: torch.device | None = None, *, nccl: Any = None) -> dist.ProcessGroup:
    """An NCCL process group of `size` members over the round's `store`, built directly (as torchft builds its
    groups): never split from this process's default group (`_new_process_group_helper` would split from it once it
    is bound to a device, and hang); its communicator made at once and nonblocking, so that a member gone since the
    store's rendezvous fails it within TORCH_NCCL_NONBLOCKING_TIMEOUT rather than at the first collective. Registered
    like a sub-group of this world (destroy, abort); its communicator is `device`'s (default: the current GPU, which
    the topology set). `nccl`: the backend class (default torch's ProcessGroupNCCL)."""
    nccl = nccl or nccl_class()
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    options = group_options("nccl", timeout, nccl)
    options.config.blocking = False
    options.group_name = name
    prefix = dist.PrefixStore(f"{name}/", store)
    pg = dist.ProcessGroup(prefix, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    backend = nccl(dist.PrefixStore("cuda/", prefix), rank, size, options)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
    pg._set_group_name(name)
    pg._set_group_desc(GROUP_DESC)
    register_pg_in_world(pg, backend_name="nccl", store=prefix, group_name=name, backend_config="cuda:nccl")
    try:
        backend.eager_connect_single_device(device)
    except BaseException:
        c10d._abort_process_group(pg)
        raise
    return pg
