"""A decentralised round whose members shard differently: its sync plan's channels, each a process group of one rank
per member, joined through a rendezvous scope of its own on member 0's store.

Each group derives the round's `SyncPlan` once, in its `RoundContext`, from every member's S (`TrainArgs.member_shards`)
and its parameter shapes (the hello checked they agree). In every member, replica 0 of shard s joins each channel whose
owners[member_index] == s, in the plan's order, on member 0's port for shard owners[0], scope `<round prefix>/c<owners
joined by '-'>`; every rank then syncs piece by piece as its seat `Seat(member_shards, member_index, shard)`
(`SyncLoop.configure`; FL+HSDP replicas receive each bucket from replica 0). The commit vote and the catch-up's step
count travel on channel (0, ..., 0), shard 0 of every member. Members that shard alike keep the plain path: one
federation group per shard index, scopes `<prefix>/s<s>`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

from flwr_sharded.flower import rendezvous
from flwr_sharded.flower.group.contract import InstructionError, RoundRuntime
from flwr_sharded.flower.group.round_context import RoundContext, channel_scope
from flwr_sharded.parallel.sync_plan import Owners, rows_of


def model_shapes(model: Any) -> tuple[tuple[int, ...], ...]:
    """Every parameter's global shape, in the order the groups sync them."""
    return tuple(tuple(int(d) for d in p.shape) for p in model.parameters())


def model_facts(model: Any) -> dict[str, Any]:
    """What a hello says of the model, whatever the group's S: a digest of every parameter's name, global shape and
    dtype (groups of any layout must agree on it) and each parameter's rows (the strategy plans the channels)."""
    named = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    digest = hashlib.sha256(repr(named).encode()).hexdigest()[:32]
    return {"model_digest": digest, "param_rows": [rows_of(shape) for _, shape, _ in named]}


def lead_channel(members: int) -> Owners:
    """The channel of shard 0 of every member (row 0 of every parameter: it always exists)."""
    return (0,) * members


def join_channels(ctx: RoundContext, *, backend: str,
                  abort: Callable[[], str]) -> Iterator[tuple[Owners, rendezvous.FederationGroup]]:
    """Join this rank's channels of the round's plan (members that shard differently) one by one, in the plan's order
    (the same on every member: deadlock-free); each joined group is yielded at once, so that the caller releases it
    whatever comes after."""
    a, plan = ctx.args, ctx.plan
    assert plan is not None, "members that shard alike join one federation group per shard index"
    for owners in plan.channels_of(ctx.member_index, ctx.shard):
        yield owners, rendezvous.join(host=a.rendezvous_host, port=a.rendezvous_ports[owners[0]],
                               prefix=channel_scope(a.prefix, owners), rank=ctx.member_index,
                               size=len(ctx.members), rendezvous_timeout=a.rendezvous_timeout,
                               sync_timeout=a.sync_timeout, backend=backend, secret=a.secret,
                               members=a.members, abort=abort)


def prepare(runtime: RoundRuntime, ctx: RoundContext) -> None:
    """Before a round trains, on every rank alike: configure the sync loop for it (`SyncLoop.configure`: steps, weight
    bound, seat, learning rate, FedProx). InstructionError on every rank, nothing trained, if a shard of this group
    cannot take its seat (the round's layouts were checked as its `RoundContext` was built)."""
    loop, plan = runtime.loop, ctx.period_plan
    error = ""
    try:
        loop.configure(plan)
    except ValueError as exc:  # a shard of this group holds no row, or not the rows the plan expects
        error = str(exc)
    errors = sorted({e for e in runtime.gather(error) if e})  # every rank agrees before any trains
    if errors:
        loop.configure(dataclasses.replace(plan, seat=None, weight_world=ctx.replicas * ctx.shards))
        raise InstructionError(f"this group (R={ctx.replicas} x S={ctx.shards}) cannot sync with members of "
                               f"S={ctx.args.member_shards}: {'; '.join(errors)}")
