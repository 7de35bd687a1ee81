"""A round as every step of it sees it (`RoundContext`): derived once per round, on every rank alike, from the train
instruction, the run and this group's layout, and checked against this group before anything trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flwr_sharded.flower.group.contract import InstructionError
from flwr_sharded.flower.messages import TrainArgs
from flwr_sharded.flower.store_server import MAX_SCOPES, round_scopes
from flwr_sharded.parallel.schedule import Schedule
from flwr_sharded.parallel.sync_plan import Owners, Seat, SyncPlan
from flwr_sharded.training.federation import PeriodPlan

if TYPE_CHECKING:
    from flwr_sharded.flower.run_config import FlowerRun, RoundOptions


@dataclass(frozen=True)
class RoundContext:
    """One round of this group: its members, options, sync plan and this rank's seat in it, its rendezvous scopes."""

    args: TrainArgs
    """The round's train instruction."""
    members: tuple[str, ...]
    """The round's member nodes, in order; member 0 hosts the rendezvous."""
    member_index: int
    """This group's place among them."""
    options: RoundOptions
    """This round's A, K, peak learning rate and FedProx mu: the strategy's, else the run's."""
    steps: int
    """This member's local steps per sync: A, or its own (`member_steps`: the fastest member's is A)."""
    replicas: int
    """This group's R."""
    shards: int
    """This group's S."""
    shard: int
    """This rank's shard index."""
    plan: SyncPlan | None
    """The round's sync plan when its members shard differently; None: one federation group per shard index."""
    seat: Seat | None
    """Where this rank's shard sits in the plan (None: the members shard alike)."""
    scopes: tuple[str, ...]
    """The rendezvous scopes member 0 opens for the round: one per channel, or (members alike) one per shard index."""

    @classmethod
    def of(cls, args: TrainArgs, run: FlowerRun, shapes: tuple[tuple[int, ...], ...], *, replicas: int,
           shards: int, shard: int) -> RoundContext:
        """The round of `args` for shard `shard` of a group of R=`replicas` x S=`shards` training `run`'s model of
        parameter `shapes`; InstructionError (the same on every rank, nothing trained) if the group cannot take
        part."""
        if args.member_shards and args.member_shards[args.member_index] != shards:
            raise InstructionError(f"the round gives member {args.member_index} "
                                   f"S={args.member_shards[args.member_index]}, but this group runs S={shards}")
        host = args.member_shards[0] if args.member_shards else shards
        if len(args.rendezvous_ports) != host:
            raise InstructionError(f"{len(args.rendezvous_ports)} rendezvous ports for member 0's {host} shard indices")
        unequal = len(set(args.member_shards)) > 1
        plan = SyncPlan(tuple(args.member_shards), shapes) if unequal else None
        scopes = ([channel_scope(args.prefix, owners) for owners in plan.channels()] if plan is not None
                  else round_scopes(args.prefix, shards))
        if len(scopes) > MAX_SCOPES:
            raise InstructionError(f"members of S={args.member_shards} make {len(scopes)} channels, more than the "
                                   f"{MAX_SCOPES} rendezvous scopes member 0's store holds")
        options = args.round.for_run(run)
        steps = args.local_steps(options.aggregate_every)
        p = run.train.parallel
        try:
            Schedule(steps, p.sync_fragments, p.sync_delay)
        except ValueError as exc:
            raise InstructionError(f"aggregate-every {steps} of this round does not fit sync-fragments "
                                   f"{p.sync_fragments} and sync-delay {p.sync_delay}: {exc}") from None
        return cls(args=args, members=tuple(args.members), member_index=args.member_index, options=options,
                   steps=steps, replicas=replicas, shards=shards, shard=shard, plan=plan,
                   seat=Seat(tuple(args.member_shards), args.member_index, shard) if unequal else None,
                   scopes=tuple(scopes))

    @property
    def period_plan(self) -> PeriodPlan:
        """How the round's periods run (`SyncLoop.configure`). A member's weight is bounded by what the round's
        largest member trains in a period: every member runs the run's R (the hello refuses another), the most
        local steps any member takes."""
        return PeriodPlan(aggregate_every=self.options.aggregate_every, steps=self.steps,
                          most_steps=max(self.args.member_steps, default=0),
                          weight_world=self.replicas * max(self.args.member_shards or [self.shards]),
                          seat=self.seat, lr=float(self.options.lr), proximal_mu=float(self.options.proximal_mu))


def channel_scope(prefix: str, owners: Owners) -> str:
    """The rendezvous scope of one channel of round `prefix`."""
    return f"{prefix}/c{'-'.join(map(str, owners))}"
