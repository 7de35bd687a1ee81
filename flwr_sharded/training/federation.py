"""What a rank's sync loop runs over and what it tells its caller: the `Federation` its syncs run in (the static
engine's `static_run.StaticFederation`, a Flower round's `flwr_sharded.flower.group.round.RoundFederation`), each
fragment sync's `SyncOutcome` and who is `at_fault`, the `PeriodPlan` a Flower round sets, the `RunReport` of a
`SyncLoop.run`, and `SyncFailed`, where the static engine stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from flwr_sharded.parallel.flight import SyncStats
from flwr_sharded.parallel.sync import Groups
from flwr_sharded.parallel.sync_plan import Seat


class SyncFailed(RuntimeError):
    """A sync that no member adopted (every rank is back at its last commit, or stops here)."""


class Federation(Protocol):
    """Where a rank's syncs run and how the ranks of its group learn each other's outcome."""

    member_index: int
    """This group's index among the members."""
    members: int
    wait_timeout: float | None
    """How long a merge waits for an overlapped sync's reduction (None: unbounded)."""

    def join(self) -> Groups:
        """Replica 0: the federation's process group(s) the first time (a round's rendezvous), None afterwards;
        raises, with the members at fault in `.missing` where known, if that fails."""

    def vote_group(self) -> dist.ProcessGroup | None:
        """The federation's group of this rank's shard index (replica 0, once joined); None: nothing to vote with."""

    def gather(self, obj: Any) -> list[Any]:
        """Every rank of this group's `obj` (collective over the group)."""

    def flags(self, values: list[int]) -> list[int]:
        """The element-wise maximum of `values` over this group's ranks (one small all-reduce)."""

    def behind(self, adopted: int) -> list[int]:
        """The members whose count of `adopted` merges is below another's (`admission.behind`), from one exchange
        between the members that no sync in flight uses; [] on a rank that does not take part (its group's outcome
        reaches it through `flags`)."""

    def period_times(self, step_s: float, sync_s: float, steps: int, *, now: bool) -> dict[str, list[float]] | None:
        """After a period: every member's step time, sync seconds, idle seconds and steps (collective over the
        world); None where they are not exchanged (a Flower round: the strategy times its members). `now=False`:
        the exchange is only started (no rank waits for another member) and the times returned are the previous
        period's (None after the first); `last_times` returns the newest."""

    def last_times(self) -> dict[str, list[float]] | None:
        """The times of the last period exchanged with `now=False` that no call returned yet (None if none)."""


@dataclass
class SyncOutcome:
    """One fragment's sync as every rank of every member ends it."""

    fragment: int
    error: str = ""
    """'' when adopted; else why not (every rank is then back at its last commit)."""
    weight: float = 0.0
    """The members' total weight, as replica 0 knows it (0 elsewhere)."""
    blame: list[int] = field(default_factory=list)
    """Members held at fault for a failed sync: absent at the rendezvous, failed their part, or sent a rejected result
    (named by the offender search)."""
    left_out: list[int] = field(default_factory=list)
    """Members an adopted sync left out (weight out of bounds, or values not finite)."""
    stats: SyncStats | None = None
    """This rank's part of the reduction (replica 0 of a sync that reached it)."""
    collective_failed: bool = False
    """A collective of the sync failed or timed out on some rank (not a rejected result): on NCCL its communicators
    are aborted."""
    deferred: bool = False
    """An overlapped sync that failed in this group alone: nothing was merged or restored, and training goes on;
    every member undoes the merges since the last confirmation at their next exchange (where this group's count of
    adopted merges is behind)."""

    @property
    def adopted(self) -> bool:
        return not self.error


def at_fault(exc: BaseException) -> list[int]:
    """The members an error holds at fault: absent at the rendezvous (`missing`), or found to have sent a rejected
    result (`offenders`, `flwr_sharded.parallel.offender`)."""
    return sorted({*getattr(exc, "missing", []), *getattr(exc, "offenders", [])})


@dataclass(frozen=True)
class PeriodPlan:
    """How the periods to come run, as a Flower round sets them (the static engine's come from its config)."""

    aggregate_every: int
    """A: the run's clock steps per period (the fastest member's local steps)."""
    steps: int
    """This group's local steps per period."""
    most_steps: int
    """The most local steps any member takes per period (0: `steps`): a member's weight is bounded by them."""
    weight_world: int
    """The most ranks of any member: a member's weight is bounded by them."""
    seat: Seat | None
    """Where this rank's shard sits among members that shard differently (None: they shard alike)."""
    lr: float
    """The schedule's peak learning rate."""
    proximal_mu: float
    """FedProx's mu (0: off)."""


@dataclass
class RunReport:
    """What `SyncLoop.run` did."""

    periods: int = 0
    """Periods completed."""
    syncs: int = 0
    """Fragment syncs adopted."""
    train_s: float = 0.0
    sync_s: float = 0.0
    error: str = ""
    """Why the run ended at a failed sync ('' if it did not)."""
    blame: set[int] = field(default_factory=set)
    left_out: set[int] = field(default_factory=set)
    weight: float = 0.0
    """The members' total weight over the adopted syncs of the last fragment."""
    sync_bytes: int = 0
    """Payload bytes this rank sent over the federation's groups in the adopted syncs (the wire's, not fp32's)."""


__all__ = ["Federation", "PeriodPlan", "RunReport", "SyncFailed", "SyncOutcome", "at_fault"]
