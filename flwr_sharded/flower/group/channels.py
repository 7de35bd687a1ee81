"""A decentralised round whose members shard differently: its sync plan's channels, each a process group of one rank
per member, joined through a rendezvous scope of its own on member 0's store.

Each group derives the round's `SyncPlan` from every member's S (`TrainArgs.member_shards`) and its parameter shapes
(the hello checked they agree). In every member, replica 0 of shard s joins each channel whose owners[member_index] ==
s, in the plan's order, on member 0's port for shard owners[0], scope `<round prefix>/c<owners joined by '-'>`; every
rank then syncs piece by piece as its seat `Seat(member_shards, member_index, shard)` (`SyncLoop.configure`; FL+HSDP
replicas receive each bucket from replica 0). The commit vote and the catch-up's step count travel on channel
(0, ..., 0), shard 0 of every member. Members that shard alike keep the plain path: one federation group per shard
index, scopes `<prefix>/s<s>`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

from flwr_sharded.flower import rendezvous
from flwr_sharded.flower.group.server_path import InstructionError
from flwr_sharded.flower.messages import TrainArgs
from flwr_sharded.flower.store_server import MAX_SCOPES, round_scopes
from flwr_sharded.parallel.schedule import Schedule
from flwr_sharded.parallel.sync_plan import Owners, Seat, SyncPlan, rows_of
from flwr_sharded.training.sync_loop import PeriodPlan


def model_shapes(model: Any) -> tuple[tuple[int, ...], ...]:
    """Every parameter's global shape, in the order the groups sync them."""
    return tuple(tuple(int(d) for d in p.shape) for p in model.parameters())


def model_facts(model: Any) -> dict[str, Any]:
    """What a hello says of the model, whatever the group's S: a digest of every parameter's name, global shape and
    dtype (groups of any layout must agree on it) and each parameter's rows (the strategy plans the channels)."""
    named = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    digest = hashlib.sha256(repr(named).encode()).hexdigest()[:32]
    return {"model_digest": digest, "param_rows": [rows_of(shape) for _, shape, _ in named]}


def round_plan(args: TrainArgs, shapes: tuple[tuple[int, ...], ...]) -> SyncPlan | None:
    """The sync plan of a round whose members shard differently; None when they shard alike."""
    if len(set(args.member_shards)) <= 1:
        return None
    return SyncPlan(tuple(args.member_shards), shapes)


def seat_of(args: TrainArgs, shard: int) -> Seat | None:
    """Where shard `shard` of this member sits in the round (None: the members shard alike)."""
    if len(set(args.member_shards)) <= 1:
        return None
    return Seat(tuple(args.member_shards), args.member_index, shard)


def channel_scope(prefix: str, owners: Owners) -> str:
    """The rendezvous scope of one channel of round `prefix`."""
    return f"{prefix}/c{'-'.join(map(str, owners))}"


def lead_channel(members: int) -> Owners:
    """The channel of shard 0 of every member (row 0 of every parameter: it always exists)."""
    return (0,) * members


def host_scopes(args: TrainArgs, shards: int, shapes: tuple[tuple[int, ...], ...]) -> list[str]:
    """The scopes member 0 opens for the round: one per channel, or (members alike) one per shard index."""
    plan = round_plan(args, shapes)
    if plan is None:
        return round_scopes(args.prefix, shards)
    return [channel_scope(args.prefix, owners) for owners in plan.channels()]


def join_channels(args: TrainArgs, plan: SyncPlan, shard: int, *, backend: str,
                  abort: Callable[[], str]) -> Iterator[tuple[Owners, rendezvous.FederationGroup]]:
    """Join this rank's channels one by one, in the plan's order (the same on every member: deadlock-free); each
    joined group is yielded at once, so that the caller releases it whatever comes after."""
    for owners in plan.channels_of(args.member_index, shard):
        yield owners, rendezvous.join(host=args.rendezvous_host, port=args.rendezvous_ports[owners[0]],
                               prefix=channel_scope(args.prefix, owners), rank=args.member_index,
                               size=len(args.members), rendezvous_timeout=args.rendezvous_timeout,
                               sync_timeout=args.sync_timeout, backend=backend, secret=args.secret,
                               members=args.members, abort=abort)


def prepare(runtime: Any, args: TrainArgs) -> None:
    """Before a round trains, on every rank alike: check the round's layouts against this group and configure the sync
    loop for it (`SyncLoop.configure`: steps, weight bound, seat, learning rate, FedProx). InstructionError on every
    rank, nothing trained, if this group cannot take part."""
    own, loop, p = runtime.args.shards, runtime.loop, runtime.run.train.parallel
    if args.member_shards and args.member_shards[args.member_index] != own:
        raise InstructionError(f"the round gives member {args.member_index} S={args.member_shards[args.member_index]}"
                               f", but this group runs S={own}")
    host = args.member_shards[0] if args.member_shards else own
    if len(args.rendezvous_ports) != host:
        raise InstructionError(f"{len(args.rendezvous_ports)} rendezvous ports for member 0's {host} shard indices")
    scopes = host_scopes(args, own, model_shapes(loop.trainer.model))
    if len(scopes) > MAX_SCOPES:
        raise InstructionError(f"members of S={args.member_shards} make {len(scopes)} channels, more than the "
                               f"{MAX_SCOPES} rendezvous scopes member 0's store holds")
    options = args.round.for_run(runtime.run)
    steps = args.local_steps(options.aggregate_every)
    try:
        Schedule(steps, p.sync_fragments, p.sync_delay)
    except ValueError as exc:
        raise InstructionError(f"aggregate-every {steps} of this round does not fit sync-fragments "
                               f"{p.sync_fragments} and sync-delay {p.sync_delay}: {exc}") from None
    # a member's weight is bounded by what the round's largest member trains in a period: every member runs the
    # run's R (the hello refuses another), the most local steps any member takes
    plan = PeriodPlan(aggregate_every=options.aggregate_every, steps=steps,
                      most_steps=max(args.member_steps, default=0),
                      weight_world=runtime.args.replicas * max(args.member_shards or [own]),
                      seat=seat_of(args, runtime.topo.shard_index), lr=float(options.lr),
                      proximal_mu=float(options.proximal_mu))
    error = ""
    try:
        loop.configure(plan)
    except ValueError as exc:  # a shard of this group holds no row, or not the rows the plan expects
        error = str(exc)
    errors = sorted({e for e in runtime.gather(error) if e})  # every rank agrees before any trains
    if errors:
        loop.configure(dataclasses.replace(plan, seat=None, weight_world=runtime.args.replicas * own))
        raise InstructionError(f"this group (R={runtime.args.replicas} x S={own}) cannot sync with members of "
                               f"S={args.member_shards}: {'; '.join(errors)}")
