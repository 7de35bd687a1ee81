"""Per-round federation process groups between Flower groups: one small group per shard index, bounded timeouts.

Each group's rank 0 hosts one persistent `TCPStore` server per shard index s (the "rendezvous offer" of its hello).
For a round, the ServerApp names the members (ordered) and takes member 0's offer; in every member, the rank
holding shard s (replica 0) joins a process group of len(members) ranks through `PrefixStore(<round prefix>/s<s>,
TCPStore client at host:ports[s])`, with rank = its member index. Every wait is bounded: connecting to the store by
`rendezvous_timeout`, the backend's own rendezvous and every collective by `sync_timeout`. A group that failed is
destroyed and never reused; the next round builds new ones under a new prefix.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

logger = logging.getLogger(__name__)


GLOO_CONNECT_ATTEMPTS = 5
"""How many times gloo retries connecting a pair, each with the group's timeout (measured: torch 2.13)."""
MIN_CONNECT_S = 10.0
"""Shortest timeout a federation group is built with (then raised to sync_timeout for its collectives)."""
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


class RendezvousError(RuntimeError):
    """The federation process group could not be formed in time (a peer is missing, late or unreachable)."""


def serve_stores(host: str, count: int, ports: list[int] | None = None) -> list[dist.TCPStore]:
    """Start `count` TCPStore servers on `host` (port 0: any free port); they live as long as the objects."""
    stores = []
    for s in range(count):
        port = ports[s] if ports else 0
        stores.append(dist.TCPStore(host, port, world_size=None, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60)))
    return stores


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
         sync_timeout: float, backend: str = "gloo", device: torch.device | None = None) -> FederationGroup:
    """Join the federation group `prefix` of `size` members as `rank`, through the store at host:port.

    Raises RendezvousError if the store cannot be reached or the other members do not arrive in time.
    """
    if not 0 <= rank < size:
        raise ValueError(f"member index {rank} outside a group of {size}")
    try:
        client = dist.TCPStore(host, port, world_size=None, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=rendezvous_timeout))
    except Exception as exc:  # DistNetworkError, DistStoreError, RuntimeError
        raise RendezvousError(f"cannot reach the rendezvous store at {host}:{port} within "
                              f"{rendezvous_timeout:.0f} s: {first_line(exc)}") from exc
    store = dist.PrefixStore(prefix, client)
    # Count arrivals first: a missing member then fails here, within the rendezvous timeout, before any backend
    # (NCCL's watchdog would tear the process down on a collective timeout).
    try:
        store.add("arrived", 1)
        store.set(f"member/{rank}", "1")
        store.wait([f"member/{r}" for r in range(size)], timedelta(seconds=rendezvous_timeout))
    except Exception as exc:
        missing = _missing_members(store, size)
        raise RendezvousError(f"federation group {prefix}: member(s) {missing} did not arrive within "
                              f"{rendezvous_timeout:.0f} s ({first_line(exc)})") from exc
    name = f"flwr-fed:{prefix}"
    # gloo connects every pair when the group is built and retries a silent peer GLOO_CONNECT_ATTEMPTS times with the
    # group's timeout: build it with a fraction of sync_timeout (so a peer frozen mid-handshake costs about
    # sync_timeout in all, not 5x), but at least MIN_CONNECT_S (the wait for a peer's address is not retried, and a
    # loaded machine can stall a process for seconds), then give the collectives the whole sync_timeout.
    connect_s = sync_timeout
    if backend == "gloo":
        connect_s = min(sync_timeout, max(MIN_CONNECT_S, sync_timeout / GLOO_CONNECT_ATTEMPTS))
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
    # Registered like a sub-group of this process's world, so that get_rank(group) and destroy work.
    c10d._world.pg_group_ranks[pg] = {dist.get_rank(): rank}
    return FederationGroup(pg=pg, rank=rank, size=size, name=name, store=store, backend=backend)


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


def _missing_members(store: dist.Store, size: int) -> list[int]:
    missing = []
    for r in range(size):
        try:
            if not store.check([f"member/{r}"]):
                missing.append(r)
        except Exception:  # noqa: BLE001 - store gone: report all as unknown
            return list(range(size))
    return missing


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
