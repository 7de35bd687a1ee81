"""The outer loop of one rank: sync periods of A local steps, their shard syncs, the commit and the rollback.

As torchft's DiLoCo owns sync, commit and rollback, `OuterLoop` owns everything between two inner steps that is not
the step itself: the schedule (A, fragments, delay, alpha, carry), each fragment's token count (its weight), starting
an overlapped sync and merging it, the members' agreement on the outcome (admission inside the sync, then a
two-phase commit), the post-sync reset (inner optimizer state, FedProx anchor) and the rollback point (shards, outer
state, inner optimizer state, step and learning-rate schedule).

The static engine's loop (`Trainer.run`) and a Flower group's round (`flwr_sharded.flower.group.round`) call the
same `after_step` after every inner step; they differ only in their `Federation`: the static world's mesh, bound
once, or a round's members, joined at the round's rendezvous. A sync is adopted only when every rank of every
member succeeded:

- phase one: replica 0 of each shard index runs its part of the sync; the group's ranks learn each other's outcome
  (`Federation.gather`);
- phase two: each replica 0 tells the members whether its whole group succeeded (`commit_vote` over the
  federation's group); FL+HSDP's other replicas then receive the result by broadcast.

A sync that fails anywhere puts every rank of every member back at its last commit (`RollbackPoint.restore`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from flwr_sharded.errors import first_line
from flwr_sharded.parallel.admission import SyncRejected, commit_vote
from flwr_sharded.parallel.rollback import RollbackPoint
from flwr_sharded.parallel.schedule import Schedule
from flwr_sharded.parallel.streaming import FragmentedSync
from flwr_sharded.parallel.sync import SyncStats, local_shard
from flwr_sharded.parallel.topology import Topology

logger = logging.getLogger(__name__)


class SyncFailed(RuntimeError):
    """A sync that no member adopted (every rank is back at its last commit, or stops here)."""


class Federation(Protocol):
    """Where a rank's syncs run and how the ranks of its group learn each other's outcome."""

    member_index: int
    """This group's index among the members (the federation group's rank of its replica 0s)."""
    members: int
    """How many members the federation has."""
    wait_timeout: float | None
    """How long an overlapped sync's merge waits for its reduction (None: unbounded)."""

    def join(self) -> None:
        """Replica 0: bind the syncs to this federation's group (a round's rendezvous, once); raises, with the
        members at fault in `.missing` where known, if that fails."""

    def vote_group(self) -> dist.ProcessGroup | None:
        """The federation's group of this rank's shard index (replica 0, once joined); None: nothing to vote with."""

    def gather(self, obj: Any) -> list[Any]:
        """Every rank of this group's `obj` (collective over the group)."""

    def flags(self, values: list[int]) -> list[int]:
        """The element-wise maximum of `values` over this group's ranks (one small all-reduce)."""


class StaticFederation:
    """The static torchrun world's federation: the mesh's "fed" groups, bound when the trainer is built. The group's
    ranks agree over a gloo group of their own: the group's process group also carries an async checkpoint's
    collectives, from its thread."""

    def __init__(self, topo: Topology, wait_timeout: float | None) -> None:
        self.topo, self.wait_timeout = topo, wait_timeout
        self.member_index, self.members = topo.fed_index, topo.config.federations
        groups = [dist.new_group(topo.group_ranks(f), backend="gloo") for f in range(self.members)]
        self.control = groups[topo.fed_index]  # every rank makes every group, in the same order
        self.leaders = topo.leaders or dist.new_group([topo.group_ranks(f)[0] for f in range(self.members)])
        """Rank 0 of every group (their timings after each period, `flwr_sharded.training.pace`)."""

    def join(self) -> None:
        pass

    def vote_group(self) -> dist.ProcessGroup | None:
        if self.topo.leaders is not None:  # groups that shard differently: their rank 0s vote for them
            return self.topo.leaders if self.topo.group_rank == 0 else None
        return self.topo.fed_group if self.topo.replica_index == 0 else None

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.topo.group_world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def flags(self, values: list[int]) -> list[int]:
        box = torch.tensor(values, dtype=torch.int32)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.control)
        return box.tolist()


@dataclass
class FaultInjection:
    """Test-only faults of one rank (hidden `--debug-*` flags of both entry points), counted in sync attempts."""

    fail_sync: int = 0
    """The N-th attempt fails on this rank after its reduction succeeded everywhere (the commit vote's case)."""
    nan_sync: int = 0
    """This rank brings NaN shards and NaN moments to the N-th attempt (admission and healing)."""


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

    @property
    def adopted(self) -> bool:
        return not self.error


def at_fault(exc: BaseException) -> list[int]:
    """The members an error holds at fault: absent at the rendezvous (`missing`), or found to have sent a rejected
    result (`offenders`, `flwr_sharded.parallel.offender`)."""
    return sorted({*getattr(exc, "missing", []), *getattr(exc, "offenders", [])})


class InnerState(Protocol):
    """What the outer loop needs of the trainer it drives."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def fragment_params(self, i: int) -> list[torch.nn.Parameter]: ...

    def set_anchor(self, fragment: int | None = None) -> None: ...

    def clock(self) -> dict[str, Any]: ...

    def set_clock(self, state: dict[str, Any]) -> None: ...


class OuterLoop:
    """One rank's outer loop over a fragmented shard sync: `after_step` after every inner step does what the
    schedule says (merges, then starts), each merge adopted by a two-phase commit or rolled back.

    Args:
        inner: the trainer whose shards, optimizer and clock the loop syncs, resets and restores.
        sync: the fragmented shard sync, bound to the static world's groups or rebound per round.
        topo: this rank's place in the mesh.
        alpha: `sync-alpha`, the merge's mixing.
        reset_optimizer_state: clear a fragment's inner optimizer state after each adopted sync.
        max_weight: the most a member may weigh in a sync after a given number of steps (admission's bound).
    """

    def __init__(self, inner: InnerState, sync: FragmentedSync, topo: Topology, *, alpha: float,
                 reset_optimizer_state: bool, max_weight: Callable[[int], float]) -> None:
        self.inner, self.sync, self.topo = inner, sync, topo
        self.alpha, self.reset_optimizer_state = alpha, reset_optimizer_state
        self._max_weight = max_weight
        self.most_steps = 0
        """The most steps any member trains per period when members train different numbers (`group-steps`); 0:
        the schedule's A."""
        self.tokens = [0] * len(sync.fragments)
        """This rank's tokens since each fragment's last sync started (its weight in the next one)."""
        self.rollback: RollbackPoint | None = None
        """The last adopted sync (`keep_rollback_point`); None: a failed sync cannot be undone on this rank."""
        self.faults = FaultInjection()
        self.attempts = 0
        """Fragment syncs attempted (`FaultInjection` counts them)."""
        self._start_errors: dict[int, tuple[str, list[int]]] = {}
        if topo.replica_index == 0:  # only replica 0 joins the cross-group step
            sync.capture_global()  # the start of the first sync period, for outer optimizers and reduced wires

    # ----- the schedule -------------------------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        return self.sync.schedule

    def set_aggregate_every(self, aggregate_every: int) -> None:
        """Periods of `aggregate_every` local steps from now on (a round's A); ValueError if the fragments and delay
        do not fit it."""
        s = self.sync.schedule
        if aggregate_every != s.aggregate_every:
            self.sync.schedule = Schedule(aggregate_every, s.fragments, s.delay)

    def due(self, step: int) -> bool:
        """Whether a sync merges or starts after `step` (1..A) of the period."""
        return bool(self.schedule.merges(step) or self.schedule.starts(step))

    def count(self, tokens: int) -> None:
        """An inner step's tokens, on this rank, towards every fragment's next weight."""
        self.tokens = [n + tokens for n in self.tokens]

    def take_weight(self, i: int) -> float:
        """This group's weight in fragment i's sync (its tokens since that fragment's last sync started), and a new
        count from now on."""
        weight = float(self.tokens[i] * self.topo.group_world)  # every rank of a group sees equal batches
        self.tokens[i] = 0
        schedule = self.sync.schedule
        # no group can have trained on more than a period (and the delay of an overlapped sync) of full batches
        self.sync.set_max_weight(self._max_weight(max(schedule.aggregate_every, self.most_steps) + schedule.delay))
        return weight

    def bound_weights(self, max_weight: Callable[[int], float]) -> None:
        """The most a member may weigh in a sync after a given number of steps, from now on (a round whose largest
        member has more ranks than this group)."""
        self._max_weight = max_weight

    # ----- commit and rollback ------------------------------------------------------------------------------------
    def keep_rollback_point(self) -> None:
        """Keep a host copy of the last adopted sync from now on (what `restore` returns to), committed now."""
        if self.rollback is None:
            self.rollback = RollbackPoint([(s.params, s) for s in self.sync.fragments], self.inner.optimizer,
                                          clock=self.inner.clock, set_clock=self.inner.set_clock)
        self.rollback.commit()

    def commit(self, fragment: int | None = None) -> None:
        """The current state (of one fragment, or all) is what a failed sync returns to."""
        if self.rollback is not None:
            self.rollback.commit(fragment)

    def restore(self) -> None:
        """Every fragment back at its last commit, the step and schedule at the newest one; no sync in flight."""
        self.abandon()
        if self.rollback is not None:
            self.rollback.restore()

    def abandon(self, timeout: float = 5.0) -> None:
        """Drop the syncs in flight and restart every fragment's token count."""
        self.sync.abandon(timeout)
        self.tokens = [0] * len(self.tokens)
        self._start_errors.clear()

    def after_sync(self, fragment: int | None = None) -> None:
        """What follows every adopted sync of a fragment (or of all) on every rank: the optimizer's state of its
        parameters cleared if configured, and the FedProx anchor set."""
        if self.reset_optimizer_state:
            params = self.inner.model.parameters() if fragment is None else self.inner.fragment_params(fragment)
            for param in params:
                self.inner.optimizer.state.pop(param, None)
        self.inner.set_anchor(fragment)

    # ----- the loop -----------------------------------------------------------------------------------------------
    def after_step(self, step: int, federation: Federation, *, apply_rule: bool = True) -> list[SyncOutcome]:
        """After `step` (1..A) of a period: merge the fragments due (each adopted or rolled back), then start the
        overlapped syncs due. Returns the merges' outcomes; a failed one is the last (nothing starts after it)."""
        outcomes = []
        for i in self.schedule.merges(step):
            outcomes.append(self.merge(i, federation, apply_rule=apply_rule))
            if not outcomes[-1].adopted:
                return outcomes
        for i in self.schedule.starts(step):
            self.start(i, federation)
        return outcomes

    def start(self, i: int, federation: Federation) -> None:
        """Replica 0: begin fragment i's overlapped sync (joining the federation first); an error is kept for the
        merge, where every rank learns it. Replicas > 0 only restart the fragment's token count."""
        if self.topo.replica_index != 0:
            self.take_weight(i)
            return
        try:
            federation.join()
            self.start_flight(i)
        except Exception as exc:  # noqa: BLE001 - rendezvous, peer gone, misaligned shards
            self._start_errors[i] = (f"shard {self.topo.shard_index}: {first_line(exc)}",
                                     at_fault(exc))

    def start_flight(self, i: int) -> None:
        """Fragment i's shards copied out and reduced in the background while the next steps compute."""
        self.sync.start(i, self.take_weight(i))

    def complete(self, i: int, *, apply_rule: bool = True, timeout: float | None = None) -> SyncStats:
        """Replica 0: fragment i's reduction into its shards (a blocking sync, or the overlapped one's bounded wait
        and merge, with `sync-alpha` mixing); raises if it failed. `apply_rule=False`: stop at the weighted mean (a
        facility-level sync of a hierarchical federation)."""
        if self.schedule.delay == 0:
            return self.sync.sync_fragment(i, self.take_weight(i), apply_rule=apply_rule, alpha=self.alpha)
        if self.sync.flights[i].in_flight:
            self.sync.wait(i, timeout)
        return self.sync.merge(i, alpha=self.alpha, apply_rule=apply_rule)

    def merge(self, i: int, federation: Federation, *, apply_rule: bool = True) -> SyncOutcome:
        """Fragment i's sync with the members (blocking, or the merge of the overlapped one started `sync-delay`
        steps ago), adopted by a two-phase commit. On failure every rank of every member is back at its last
        commit and no sync is left in flight. A rank whose own collective failed does not vote (its peers' vote then
        fails too, within the sync timeout, or at once when its group is released)."""
        outcome = SyncOutcome(fragment=i)
        error, blame = self._start_errors.pop(i, ("", []))
        agreed = False  # a rejection every member of this shard index reached too (nobody's failure to vote no for)
        self.attempts += 1
        if self.attempts == self.faults.nan_sync:
            self._poison()
        reached = False
        if self.topo.replica_index == 0 and not error:
            try:
                federation.join()
                outcome.stats = self.complete(i, apply_rule=apply_rule, timeout=federation.wait_timeout)
                outcome.weight, reached = outcome.stats.total_weight, True
                if self.attempts == self.faults.fail_sync:
                    error = f"--debug-fail-sync {self.faults.fail_sync}: failed after the reduction"
            except Exception as exc:  # noqa: BLE001 - rendezvous, timeout, peer gone, rejected, misaligned shards
                error = f"shard {self.topo.shard_index}: {first_line(exc)}"
                blame, agreed = at_fault(exc), isinstance(exc, SyncRejected)
        elif self.topo.replica_index != 0 and self.schedule.delay == 0:
            self.take_weight(i)  # a replica > 0 receives the result by broadcast below
        errors, noes = self._agree(i, federation, (error, blame, agreed), reached, outcome)
        if errors:
            self.restore()
            outcome.error = "; ".join(errors)
            return outcome
        if self.topo.rep_group is not None:
            self.sync.fragments[i].broadcast(self.topo.rep_group)
        self.after_sync(i)
        if federation.member_index in outcome.left_out and self.rollback is not None:
            self.rollback.restore_optimizer(i)  # healed by the others' mean; its moments may hold the same NaN
        self.commit(i)
        return outcome

    def _agree(self, i: int, federation: Federation, mine: tuple[str, list[int], bool], reached: bool,
               outcome: SyncOutcome) -> tuple[list[str], list[int]]:
        """The two phases of the commit: (every error any rank of any member saw, the members that voted no);
        fills the outcome's blame and left-out members. `mine`: this rank's (error, members at fault, whether the
        error is a rejection every member reached, which no member is blamed for by voting no). When nothing went wrong each phase is one small all-reduce
        over the group; the ranks' messages are gathered only when some rank has one."""
        error, blame, _ = mine
        phase_one = [mine]
        if federation.flags([int(bool(error or blame))])[0]:
            phase_one = federation.gather(mine)
        errors = sorted({e for e, _, _ in phase_one if e})
        own = [e for e, _, agreed in phase_one if e and not agreed]  # a rejection all members reached is nobody's
        vote_error, noes = "", []
        group = federation.vote_group() if reached else None
        if group is not None:
            try:
                noes = commit_vote(not own, group, local_shard(self.sync.fragments[i].params[0]).device)
            except Exception as exc:  # noqa: BLE001 - a member gone between the phases
                vote_error = f"shard {self.topo.shard_index}: commit vote: {first_line(exc)}"
        left_out = self.sync.fragments[i].left_out if reached else []
        mask = [int(j in left_out) for j in range(federation.members)]
        reduced = federation.flags([int(bool(vote_error or noes)), *mask])
        phase_two = [(vote_error, noes, [j for j, out in enumerate(reduced[1:]) if out])]
        if reduced[0]:
            phase_two = federation.gather((vote_error, noes, left_out))
        noes = sorted({j for _, js, _ in phase_two for j in js})
        outcome.blame = sorted({j for _, js, _ in phase_one for j in js} | set(noes))
        errors += sorted({e for e, _, _ in phase_two if e})
        if noes and not errors:
            errors.append(f"member(s) {noes} did not complete the sync: no member adopts it")
        outcome.left_out = [] if errors else sorted({j for _, _, js in phase_two for j in js})
        return errors, noes

    @torch.no_grad()
    def _poison(self) -> None:
        """`FaultInjection.nan_sync`: a diverged rank, NaN in a shard and in its moments."""
        logger.error("--debug-nan-sync %d: NaN in this rank's first shard and its optimizer state", self.attempts)
        param = next(iter(self.inner.model.parameters()))
        local_shard(param).view(-1)[0] = float("nan")
        for value in self.inner.optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local_shard(value).fill_(float("nan"))
