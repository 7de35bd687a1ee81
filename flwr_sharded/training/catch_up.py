"""A Flower round's steps that adopt another's state instead of a sync: a member (re)joined, and every member adopts
member 0's (`catch_up`); the server path's mean, which the group's rule steps on (`adopt_mean`). Each commits what
it adopted (`SyncLoop.commits`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flwr_sharded.errors import first_line
from flwr_sharded.parallel.collectives import bounded
from flwr_sharded.training.federation import Federation

if TYPE_CHECKING:
    from flwr_sharded.training.sync_loop import SyncLoop

logger = logging.getLogger(__name__)


def catch_up(loop: SyncLoop, federation: Federation) -> str:
    """A member (re)joined: every member adopts member 0's shards, global state and clock; returns '' or the
    error (then every rank is back at the last commit). Replica 0 of each shard index receives them over the
    round's group of that index (or piece by piece over each channel); FL+HSDP replicas then copy replica 0."""
    t, error, step = loop.trainer, "", loop.trainer.schedule_step
    if loop.replica0:
        try:
            loop.bind(federation)
            group = federation.vote_group()
            over = group if loop.syncs[0].seat is None else None  # None: over each bucket's channel
            for s in loop.syncs:
                s.broadcast(over, source=0)
            for s in loop.syncs:
                s.broadcast_global(over, source=0)
            if group is not None:  # the clock travels on shard index 0's group
                box = torch.tensor([step], dtype=torch.int64, device=t.device)
                bounded(dist.broadcast, box, group=group, group_src=0)
                step = int(box.item())
        except Exception as exc:  # noqa: BLE001 - rendezvous, timeout, peer gone
            error = f"shard {loop.topo.shard_index}: {first_line(exc)}"
    errors = sorted({e for e in federation.gather(error) if e})
    if errors:
        loop.commits.restore()
        return "; ".join(errors)
    if loop.topo.rep_group is not None:
        for s in loop.syncs:
            s.broadcast(loop.topo.rep_group)
    step = federation.gather(step)[0]  # rank 0 (replica 0, shard 0) knows member 0's clock
    if (step, step) != (t.step_count, t.schedule_step):
        logger.info("caught up: step %d -> %d (member 0's clock)", t.step_count, step)
        t.step_count = step
        t.move_schedule(step)
    t.set_anchor()
    loop.commits.commit()
    return ""


def adopt_mean(loop: SyncLoop) -> None:
    """The server path: the server's mean is in the shards; the rule steps on it, replicas receive it, and it is
    committed."""
    if loop.replica0:
        for s in loop.syncs:
            s.step_rule()  # the outer optimizer, on this rank's own shards and state
    if loop.topo.rep_group is not None:
        for s in loop.syncs:
            s.broadcast(loop.topo.rep_group)
    loop.after_sync()
    loop.commits.commit()


__all__ = ["adopt_mean", "catch_up"]
