"""A rank's sync periods: the trainer's inner steps, the shard syncs of the model's fragments between them, the
members' agreement on each sync (a two-phase commit) and the rollback of one that fails.

As torchft's DiLoCo owns sync, commit and rollback, `SyncLoop` owns everything around the inner steps: the schedule
(A, fragments, delay, alpha, carry), the clock of `group-steps speed`, each fragment's tokens (its weight), starting
an overlapped sync and merging it, the commit and the rollback point. `SyncLoop.run` is the one loop over periods:
the static engine runs it until its last step over its static federation (`static_run.StaticFederation`), a Flower
round for the round's periods over the round's members (`flwr_sharded.flower.group.round`). A sync is adopted only
when every rank of every member succeeded:

- phase one: replica 0 of each shard index runs its part of the sync; the group's ranks learn each other's outcome
  (`Federation.flags`, one small all-reduce inside the group);
- phase two, a blocking sync: each replica 0 tells the members whether its whole group succeeded (`commit_vote`);
- phase two, an overlapped sync: nothing at the merge. The group merges, keeps the commit pending and counts the
  merge; its count travels in the members' next exchange (the next sync's admission, on the communication thread,
  or `confirm_merges` at a run's end and before a checkpoint). Equal counts confirm every pending commit; a member
  behind makes every member reject that sync and return to the last confirmed commit. The training thread so waits
  for the other members only for the data of a sync, never for a vote.

FL+HSDP's other replicas receive an adopted result by broadcast. A sync that fails anywhere puts every rank of every
member back at its last (confirmed) commit (`RollbackPoint.restore`).

What watches the loop (the traffic probe, a bench's slowed group, a test's faults) is a `SyncObserver` in
`loop.observers` (`flwr_sharded.training.observer`), called where the loop does what it names.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from flwr_sharded.errors import first_line
from flwr_sharded.parallel.admission import SyncRejected, commit_vote
from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.parallel.collectives import CollectiveTimeout, bounded
from flwr_sharded.parallel.token_weights import expected_weight_of, tokens_of
from flwr_sharded.parallel.rollback import RollbackPoint
from flwr_sharded.parallel.schedule import Schedule, fragment_parameters, local_steps
from flwr_sharded.parallel.sync import Groups, ShardSync, Snapshot, SyncStats
from flwr_sharded.parallel.sync_plan import Seat
from flwr_sharded.parallel.wire import WIRES
from flwr_sharded.training.models import transformer_blocks
from flwr_sharded.training.observer import SyncObserver, observers_for
from flwr_sharded.training.trainer import Trainer
from flwr_sharded.validation import outer_rule

logger = logging.getLogger(__name__)


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


class SyncLoop:
    """One rank's sync periods around its trainer's inner steps.

    The static engine's loop is built from the run's config; a Flower round changes it with `configure`.
    """

    def __init__(self, trainer: Trainer) -> None:
        cfg, topo, p = trainer.cfg, trainer.topo, trainer.cfg.parallel
        self.trainer, self.topo, self.cfg = trainer, topo, cfg
        self.alpha, self.reset_optimizer_state = p.sync_alpha, p.reset_optimizer_state
        self.adapt = p.group_steps == "speed"
        """Each period's steps from the groups' step times, where the federation exchanges them."""
        self.A = p.aggregate_every
        self.schedule = Schedule(p.aggregate_every, p.sync_fragments, p.sync_delay)
        self.most_steps = p.aggregate_every if self.adapt else 0
        self.weight_world = max(topo.group_worlds)
        self.syncs: list[ShardSync] = []
        """One shard sync per fragment of the model (FL methods)."""
        if p.federated:
            model = trainer.model
            snapshot, origin = Snapshot(), Snapshot() if p.carries or p.sync_max_move > 0 else None
            self.syncs = [ShardSync(part, fed_group=None, bucket_bytes=int(p.bucket_mb * (1 << 20)),
                                    rule=outer_rule(p), wire_dtype=WIRES[p.sync_dtype].torch_dtype(),
                                    error_feedback=p.sync_error_feedback, max_move=p.sync_max_move,
                                    topk=p.sync_topk, topk_merge=p.sync_topk_merge,
                                    error_decay=p.sync_error_decay, seat=topo.seat, snapshot=snapshot, origin=origin,
                                    carry=p.carries, restart_residual=p.sync_restart == "residual")
                          for part in fragment_parameters(model, transformer_blocks(model), p.sync_fragments)]
        self.tokens = [0] * len(self.syncs)
        """This rank's tokens since each fragment's last sync started (its weight in the next one)."""
        self.tokens_trained = 0
        """Tokens every group together trained in the periods whose times were exchanged."""
        self.rollback: RollbackPoint | None = None
        """The last adopted sync (`keep_rollback_point`); None: a failed sync cannot be undone on this rank."""
        self.period_start = self.clock_start = 0
        self.compute_s = 0.0
        """Seconds of inner steps in the current period (its step time, `Federation.period_times`)."""
        self.report = RunReport()
        """What the current (or last) `run` did."""
        self._start_errors: dict[int, tuple[str, list[int], bool]] = {}
        self.adopted = 0
        """Merges of overlapped syncs this group adopted in the current run (brought to the next admission)."""
        self._confirmed = 0
        """`adopted` as of the last confirmation (what a rollback returns it to)."""
        self.until: int | None = None
        """The run's last clock step, where the static engine ends (None: a Flower round's)."""
        if topo.replica_index == 0:
            for s in self.syncs:
                s.capture_global()  # the start of the first sync period
        self.observers: list[SyncObserver] = observers_for(self)
        """What sees this loop's periods, steps and syncs, in this order (`flwr_sharded.training.observer`)."""

    @property
    def steps(self) -> int:
        """This group's local steps per period."""
        return self.schedule.steps

    @property
    def replica0(self) -> bool:
        return self.topo.replica_index == 0

    @property
    def in_flight(self) -> bool:
        return any(s.in_flight for s in self.syncs)

    def fingerprint(self) -> str:
        return "|".join(s.fingerprint() for s in self.syncs)

    def configure(self, plan: PeriodPlan) -> None:
        """Run the periods to come as `plan` says (a Flower round). ValueError (nothing else changed) if its steps
        do not fit the fragments and delay; ConfigError if this rank's shards cannot sit at its seat."""
        schedule = dataclasses.replace(self.schedule, steps=plan.steps)
        if self.syncs and plan.seat != self.syncs[0].seat:
            for s in self.syncs:
                s.reseat(plan.seat, None)
            if self.syncs[0].keeps_global:
                self.commit()  # the rollback point holds the global state in the new seat's buckets
        self.schedule, self.A, self.most_steps = schedule, plan.aggregate_every, plan.most_steps
        self.weight_world = plan.weight_world
        t = self.trainer
        t.set_peak_lr(plan.lr)
        if plan.proximal_mu != t.proximal_mu:
            t.proximal_mu = plan.proximal_mu
            t.set_anchor()  # the round starts at the last sync: its shards are w_sync

    # ----- the loop ---------------------------------------------------------------------------------------------
    def reference(self) -> float:
        """The run's clock at the current step (the fastest group's step count)."""
        return self.clock_start + (self.trainer.step_count - self.period_start) * self.A / self.steps

    def run(self, federation: Federation | None, *, until: int | None = None, periods: int | None = None,
            on_step: Callable[[torch.Tensor, int | None], None] | None = None,
            on_period: Callable[[dict[str, Any] | None], None] | None = None,
            on_failure: Callable[[SyncOutcome, int, int], None] | None = None,
            confirm_at: Callable[[int], bool] | None = None, apply_rule: bool = True) -> RunReport:
        """Train periods of inner steps with the syncs the schedule puts between them: `periods` of them (a Flower
        round), or until the run's clock reaches `until` (the static engine, which may end mid-period).

        After each step, `on_step(loss, tick)` (`tick`: the run's clock where every group may act together, else
        None); after each period, `on_period(times)` (`Federation.period_times`, with the period's `reference_step`).
        `confirm_at(tick)`: whether every member confirms the merges before `on_step` sees that tick (a checkpoint
        is written there); the run's end is always confirmed. A failed sync (every rank back at its last commit)
        ends the run, unless `on_failure(outcome, failures in a row, step)` is given: it may raise, else training
        goes on from the commit. `apply_rule=False` stops each sync at the weighted mean (a facility's sync on the
        server path)."""
        t = self.trainer
        report = self.report = RunReport()
        self.until, self.adopted, self._confirmed, self._failures = until, 0, 0, 0
        self._times_reference = 0
        self.period_start = t.step_count - (t.step_count % self.steps if until is not None else 0)
        try:
            while True:
                outcome, at = self._periods(federation, report, until, periods, on_step, on_period, confirm_at,
                                            apply_rule)
                if outcome is None:  # the run's end: its merges confirmed by every member
                    at = t.step_count
                    outcome = self.confirm_merges(federation)
                    if outcome.adopted:
                        self._last_period(federation, on_period)
                        return report
                self._failures += 1
                if on_failure is None:
                    report.error = outcome.error
                    return report
                on_failure(outcome, self._failures, at)
        finally:
            if self.in_flight:
                self.abandon(federation.wait_timeout if federation is not None else 5.0)

    def _periods(self, federation: Federation | None, report: RunReport, until: int | None, periods: int | None,
                 on_step: Callable[[torch.Tensor, int | None], None] | None,
                 on_period: Callable[[dict[str, Any] | None], None] | None,
                 confirm_at: Callable[[int], bool] | None, apply_rule: bool) -> tuple[SyncOutcome | None, int]:
        """`run`'s periods until its end (None) or a failed sync (it, and the step it failed at; every rank is then
        back at its last commit)."""
        t = self.trainer
        while periods is None or report.periods < periods:
            self.clock_start = t.schedule_step - (t.step_count - self.period_start)
            for o in self.observers:
                o.on_period_start(self)
            mark, sync_s, self.compute_s = time.perf_counter(), 0.0, 0.0
            for position in range(t.step_count - self.period_start + 1, self.steps + 1):
                if until is not None and self.reference() >= until:
                    return None, 0
                began = time.perf_counter()
                for o in self.observers:
                    o.on_step_begin(self)
                loss = t.step()
                for o in self.observers:
                    o.on_step_end(self, loss)
                if self.adapt and t.device.type == "cuda":  # the step's kernels, not their launch, set the steps
                    torch.cuda.current_stream(t.device).synchronize()
                self.compute_s += time.perf_counter() - began
                self.tokens = [n + tokens_of(self.cfg, steps=1) for n in self.tokens]
                if self.steps != self.A:  # the learning-rate schedule on the fastest group's clock
                    t.move_schedule(self.clock_start + position * self.A / self.steps)
                failed: SyncOutcome | None = None
                at = t.step_count
                if federation is not None and self.schedule.due(position):
                    if t.device.type == "cuda":
                        torch.cuda.synchronize()
                    report.train_s += time.perf_counter() - mark
                    mark = time.perf_counter()
                    with t.timer.phase("sync"):
                        failed = self._syncs_after(position, federation, apply_rule, report)
                    sync_s = time.perf_counter() - mark
                    report.sync_s += sync_s
                    mark = time.perf_counter()
                    self._failures = 0 if self.schedule.merges(position) and failed is None else self._failures
                tick: int | None = None if self.adapt or failed else t.step_count
                if position == self.steps and not failed:
                    report.train_s += time.perf_counter() - mark
                    tick = tick if tick is not None else int(self.reference())  # the period's end
                    self._end_period(federation, sync_s, on_period)
                    report.periods += 1
                if tick is not None and confirm_at is not None and confirm_at(tick):
                    confirmed = self.confirm_merges(federation)
                    failed, tick = (None, tick) if confirmed.adopted else (confirmed, None)
                if on_step is not None:
                    on_step(loss, tick)
                if failed:
                    return failed, at
        return None, 0

    def _syncs_after(self, position: int, federation: Federation, apply_rule: bool,
                     report: RunReport) -> SyncOutcome | None:
        """The merges and starts the schedule puts after `position`; the first failed merge (every rank is then back
        at its last commit, and nothing starts), or None."""
        for i in self.schedule.merges(position):
            for o in self.observers:
                o.on_merge(self, i)
            outcome = self._merge(i, federation, apply_rule)
            for o in self.observers:
                o.on_outcome(self, outcome)
            report.blame.update(outcome.blame)
            report.left_out.update(outcome.left_out)
            if outcome.deferred:
                continue
            if not outcome.adopted:
                return outcome
            report.syncs += 1
            report.sync_bytes += outcome.stats.bytes if outcome.stats is not None else 0
            report.weight += outcome.weight if i == self.schedule.fragments - 1 else 0.0
        for i in self.schedule.starts(position):
            for o in self.observers:
                o.on_sync_start(self, i)
            self._start(i, federation)
            for o in self.observers:
                o.on_sync_started(self, i)
        return None

    def _end_period(self, federation: Federation | None, sync_s: float,
                    on_period: Callable[[dict[str, Any] | None], None] | None) -> None:
        """A period ended with its syncs adopted: the members' times where exchanged (and, with `adapt`, this
        group's next steps, which need this period's times now; else they are the period before's, and no rank
        waits here for another member), then a new period."""
        steps = self.steps
        times = None
        if federation is not None:
            times = federation.period_times(self.compute_s / max(1, steps), sync_s, steps, now=self.adapt)
        reference = self.clock_start + self.A
        if not self.adapt:  # the times are those of the period before
            reference, self._times_reference = self._times_reference, reference
        if times is not None:
            self._count_tokens(times)
            if self.adapt and all(s > 0 and math.isfinite(s) for s in times["step_time_s"]):
                mine = local_steps(self.A, times["step_time_s"])[federation.member_index]
                self.schedule = dataclasses.replace(self.schedule, steps=mine)
            times = {"reference_step": reference, **times}
        self.period_start = self.trainer.step_count
        if on_period is not None:
            on_period(times)
        for o in self.observers:
            o.on_period_end(self)

    def _count_tokens(self, times: dict[str, Any]) -> None:
        """Add the tokens every group trained in the period of `times` to `tokens_trained`."""
        self.tokens_trained += sum(tokens_of(self.cfg, steps=n, ranks=world)
                                   for n, world in zip(times["steps"], self.topo.group_worlds))

    def _last_period(self, federation: Federation | None,
                     on_period: Callable[[dict[str, Any] | None], None] | None) -> None:
        """The run ended: the times of its last period, where they are still outstanding."""
        times = federation.last_times() if federation is not None and not self.adapt else None
        if times is not None:
            self._count_tokens(times)
            if on_period is not None:
                on_period({"reference_step": self._times_reference, **times})

    # ----- one fragment's sync ----------------------------------------------------------------------------
    def _bind(self, federation: Federation) -> None:
        groups = federation.join()
        if groups is not None:
            for s in self.syncs:
                s.bind(groups)

    def _take_weight(self, i: int) -> float:
        """This group's weight in fragment i's sync (its tokens since that fragment's last sync started), and a new
        count from now on; bounds the members' weights by what the largest can have trained since."""
        weight = float(self.tokens[i] * self.topo.group_world)  # every rank of a group sees equal batches
        self.tokens[i] = 0
        steps = max(self.steps, self.most_steps) + self.schedule.delay
        bound = expected_weight_of(self.cfg, steps=steps, worlds=[self.weight_world])
        for s in self.syncs:
            s.max_weight = bound
        return weight

    def _start(self, i: int, federation: Federation) -> None:
        """Replica 0: begin fragment i's overlapped sync (joining the federation first); an error is kept for the
        merge, where every rank learns it. Replicas > 0 only restart the fragment's token count."""
        if not self.replica0:
            self._take_weight(i)
            return
        try:
            self._bind(federation)
            self.syncs[i].start(self._take_weight(i), overlap=True, dense=self._dense(self.schedule.delay),
                                adopted=self.adopted)
        except Exception as exc:  # noqa: BLE001 - rendezvous, peer gone, misaligned shards
            self._start_errors[i] = (f"shard {self.topo.shard_index}: {first_line(exc)}", at_fault(exc),
                                     isinstance(exc, CollectiveTimeout))

    def _dense(self, ahead: int) -> bool:
        """Whether a top-k sync started now, merged `ahead` steps later, sends every entry: within the first
        `sync-dense-warmup` periods, or the run's last sync (`sync-dense-flush`: no merge of it before `until`)."""
        p = self.cfg.parallel
        if p.sync_topk is None:
            return False
        merged = self.reference() + ahead * self.A / self.steps  # on the run's clock
        return (math.ceil(merged / self.A - 1e-9) <= p.sync_dense_warmup
                or p.sync_dense_flush and self.until is not None and merged + self.A > self.until)

    def _merge(self, i: int, federation: Federation, apply_rule: bool) -> SyncOutcome:
        """Fragment i's sync with the members: an overlapped one's merge (`_merge_overlapped`), or a blocking sync
        adopted by a two-phase commit; on failure every rank of every member is back at its last commit and no sync
        is left in flight. A rank whose own collective failed does not vote (its peers' vote then fails too, within
        the sync timeout, or at once when its group is released)."""
        if self.schedule.delay:
            return self._merge_overlapped(i, federation, apply_rule)
        outcome, sync = SyncOutcome(fragment=i), self.syncs[i]
        error, blame, broken = "", [], False
        agreed = reached = False  # agreed: a rejection every member reached too (nobody's to vote no for)
        if self.replica0:
            try:
                self._bind(federation)
                sync.start(self._take_weight(i), overlap=False, dense=self._dense(0))
                sync.receive(alpha=self.alpha, apply_rule=apply_rule, timeout=federation.wait_timeout)
                outcome.stats = sync.merge()
                outcome.weight, reached = outcome.stats.total_weight, True
                for o in self.observers:
                    o.on_reduced(self, i)  # may raise: this rank, which reached the end, then votes no
            except Exception as exc:  # noqa: BLE001 - rendezvous, timeout, peer gone, rejected, misaligned shards
                error = f"shard {self.topo.shard_index}: {first_line(exc)}"
                blame, agreed = at_fault(exc), isinstance(exc, SyncRejected)
                broken = isinstance(exc, CollectiveTimeout)
        else:
            self._take_weight(i)  # a replica > 0 receives the result by broadcast below
        errors = self._agree(i, federation, (error, blame, agreed), reached, outcome, broken)
        if errors:
            self.restore()
            outcome.error = "; ".join(errors)
            return outcome
        self._adopt(i, federation, outcome)
        self.commit(i)
        return outcome

    def _merge_overlapped(self, i: int, federation: Federation, apply_rule: bool) -> SyncOutcome:
        """The merge of fragment i's overlapped sync, started `sync-delay` steps ago: its reduction awaited, then one
        small all-reduce over this group (every rank's outcome, whether it must be undone at once, whether its
        admission confirmed the merges before, the members left out). No exchange with the other members: the merge
        is counted and its commit pending until their next exchange confirms it (module docstring). A failure that
        every member meets (a rejection, a broken collective, a failed start) puts every rank back at its last
        confirmed commit at once; one of this group alone (`SyncOutcome.deferred`) merges nothing and restores
        nothing: its count stays behind, and at their next exchange every member undoes the merges since the last
        confirmation together, at the same point of the schedule."""
        outcome, sync = SyncOutcome(fragment=i), self.syncs[i]
        error, blame, broken = self._start_errors.pop(i, ("", [], False))
        at_once, confirmed, reached = bool(error), False, False
        if self.replica0 and not error:
            try:
                sync.receive(alpha=self.alpha, apply_rule=apply_rule, timeout=federation.wait_timeout)
                for o in self.observers:
                    o.on_reduced(self, i)  # may raise: as the reduction's own error
                reached = True
            except Exception as exc:  # noqa: BLE001 - timeout, peer gone, rejected, a member behind
                error = f"shard {self.topo.shard_index}: {first_line(exc)}"
                blame, broken = at_fault(exc), isinstance(exc, (CollectiveTimeout, TimeoutError))
                at_once = broken or isinstance(exc, SyncRejected)  # the others' syncs fail too
            confirmed = sync.confirmed is True
        elif not self.replica0:
            confirmed = True  # replica 0 of its shard index speaks for it
        mask = [int(j in sync.left_out) if reached else 0 for j in range(federation.members)]
        failed, any_broken, any_at_once, unconfirmed, *left_out = federation.flags(
            [int(bool(error or blame)), int(broken), int(at_once), int(not confirmed), *mask])
        outcome.collective_failed = bool(any_broken)
        if not unconfirmed:  # every member adopted every merge before this sync
            self._confirm()
        if failed:
            self._learn_failure(federation, (error, blame), outcome)
            if any_at_once:
                self.restore(keep_pending=bool(any_broken))
            else:
                sync.abandon()
                outcome.deferred = True
                logger.warning("fragment %d's sync failed in this group alone (%s): not merged; every member undoes "
                               "the merges since the last confirmation at their next exchange", i, outcome.error)
            return outcome
        outcome.left_out = [j for j, out in enumerate(left_out) if out]
        if self.replica0:
            outcome.stats = sync.merge()
            outcome.weight = outcome.stats.total_weight
        self._adopt(i, federation, outcome)
        if self.rollback is not None:
            self.rollback.commit(i, pending=True)
        self.adopted += 1
        return outcome

    def _adopt(self, i: int, federation: Federation, outcome: SyncOutcome) -> None:
        """Every rank takes in fragment i's adopted sync: FL+HSDP's replicas receive it, the optimizer state follows,
        and a member left out for non-finite values gets its moments back from the last commit."""
        if self.topo.rep_group is not None:
            self.syncs[i].broadcast(self.topo.rep_group)
        self._after_sync(i)
        if federation.member_index in outcome.left_out and self.rollback is not None:
            self.rollback.restore_optimizer(i)  # healed by the others' mean; its moments may hold the same NaN

    def confirm_merges(self, federation: Federation | None) -> SyncOutcome:
        """Every member confirms the overlapped syncs' merges no later admission confirmed (a run's end, before a
        checkpoint): one exchange of their counts between the members (`Federation.behind`), one small all-reduce
        inside the group. Where a member is behind, every rank goes back to its last confirmed commit; the outcome
        says why. Nothing to do for blocking syncs, whose merges are committed at once."""
        outcome = SyncOutcome(fragment=self.schedule.fragments - 1)
        if federation is None or not self.schedule.delay or not self.syncs:
            return outcome
        error, blame, broken = "", [], False
        try:
            blame = federation.behind(self.adopted)
        except Exception as exc:  # noqa: BLE001 - a member gone since the last sync
            error, broken = f"shard {self.topo.shard_index}: confirming the merges: {first_line(exc)}", True
        if blame:
            error = (f"member(s) {blame} did not adopt a merge the others adopted since the last confirmation: no "
                     f"member keeps it")
        failed, any_broken = federation.flags([int(bool(error)), int(broken)])
        outcome.collective_failed = bool(any_broken)
        if not failed:
            self._confirm()
            return outcome
        self._learn_failure(federation, (error, blame), outcome)
        self.restore(keep_pending=bool(any_broken))
        return outcome

    @staticmethod
    def _learn_failure(federation: Federation, mine: tuple[str, list[int]], outcome: SyncOutcome) -> None:
        """Every rank of the group's (error, members at fault) into `outcome` (collective over the group)."""
        phase_one = federation.gather(mine)
        outcome.error = "; ".join(sorted({e for e, _ in phase_one if e}))
        outcome.blame = sorted({j for _, js in phase_one for j in js})

    def _confirm(self) -> None:
        """The pending commits stand: every member adopted the merges they hold."""
        if self.rollback is not None:
            self.rollback.confirm()
        self._confirmed = self.adopted

    def _agree(self, i: int, federation: Federation, mine: tuple[str, list[int], bool], reached: bool,
               outcome: SyncOutcome, broken: bool = False) -> list[str]:
        """The commit's two phases: every error any rank of any member saw; fills the outcome's blame and left-out
        members. `mine`: this rank's (error, members at fault, whether the error is a rejection every member
        reached; `broken`: this rank's own collective failed, `outcome.collective_failed` says if any did). When
        nothing went wrong each phase is one small all-reduce over the group."""
        error, blame, _ = mine
        phase_one = [mine]
        failed, any_broken = federation.flags([int(bool(error or blame)), int(broken)])
        outcome.collective_failed = bool(any_broken)
        if failed:
            phase_one = federation.gather(mine)
        errors = sorted({e for e, _, _ in phase_one if e})
        own = [e for e, _, agreed in phase_one if e and not agreed]  # a rejection all members reached is nobody's
        vote_error, noes = "", []
        group = federation.vote_group() if reached else None
        if group is not None:
            try:
                noes = commit_vote(not own, group, local_shard(self.syncs[i].params[0]).device)
            except Exception as exc:  # noqa: BLE001 - a member gone between the phases
                vote_error = f"shard {self.topo.shard_index}: commit vote: {first_line(exc)}"
        left_out = self.syncs[i].left_out if reached else []
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
        return errors

    def _after_sync(self, fragment: int | None = None) -> None:
        """What follows every adopted sync of a fragment (or of all) on every rank: the inner optimizer's state of
        its parameters cleared if configured, and the FedProx anchor set."""
        t = self.trainer
        params = None if fragment is None else self.syncs[fragment].params
        if self.reset_optimizer_state:
            for param in t.model.parameters() if params is None else params:
                t.optimizer.state.pop(param, None)
        t.set_anchor(params)

    # ----- commit and rollback ----------------------------------------------------------------------------
    def keep_rollback_point(self) -> None:
        """Keep a host copy of the last adopted sync from now on (what `restore` returns to), committed now."""
        if self.rollback is None:
            t = self.trainer
            self.rollback = RollbackPoint([(s.params, s.state) for s in self.syncs], t.optimizer, clock=self._clock,
                                          set_clock=self._set_clock)
        self.rollback.commit()

    def _clock(self) -> dict[str, Any]:
        """The trainer's clock and where its period started (a commit at a period's end: the next one)."""
        step = self.trainer.step_count
        return {**self.trainer.clock(),
                "period_start": step if step - self.period_start >= self.steps else self.period_start}

    def _set_clock(self, state: dict[str, Any]) -> None:
        self.trainer.set_clock(state)
        self.period_start = state["period_start"]

    def commit(self, fragment: int | None = None) -> None:
        """The current state (of one fragment, or all) is what a failed sync returns to (of all: every merge stands,
        pending or not)."""
        if self.rollback is not None:
            self.rollback.commit(fragment)
        if fragment is None:
            self._confirmed = self.adopted

    def restore(self, *, keep_pending: bool = False) -> None:
        """Every fragment back at its last commit, the step and schedule at the newest one; no sync in flight.
        `keep_pending`: the merges this group adopted since the last confirmation stand too (a collective broke:
        a member is lost, and what it adopted cannot be learnt; the members still there kept the same merges unless
        one of them lost one alone, which a Flower round's checksums and catch-up repair)."""
        if keep_pending:
            self._confirm()
        self.abandon()
        if self.rollback is not None:
            self.rollback.restore()
        self.adopted = self._confirmed

    def abandon(self, timeout: float = 5.0) -> None:
        """Drop the syncs in flight and restart every fragment's token count."""
        for s in self.syncs:
            s.abandon(timeout)
        self.tokens = [0] * len(self.tokens)
        self._start_errors.clear()

    # ----- a Flower round's other steps -------------------------------------------------------------------
    def catch_up(self, federation: Federation) -> str:
        """A member (re)joined: every member adopts member 0's shards, global state and clock; returns '' or the
        error (then every rank is back at the last commit). Replica 0 of each shard index receives them over the
        round's group of that index (or piece by piece over each channel); FL+HSDP replicas then copy replica 0."""
        t, error, step = self.trainer, "", self.trainer.schedule_step
        if self.replica0:
            try:
                self._bind(federation)
                group = federation.vote_group()
                over = group if self.syncs[0].seat is None else None  # None: over each bucket's channel
                for s in self.syncs:
                    s.broadcast(over, source=0)
                for s in self.syncs:
                    s.broadcast_global(over, source=0)
                if group is not None:  # the clock travels on shard index 0's group
                    box = torch.tensor([step], dtype=torch.int64, device=t.device)
                    bounded(dist.broadcast, box, group=group, group_src=0)
                    step = int(box.item())
            except Exception as exc:  # noqa: BLE001 - rendezvous, timeout, peer gone
                error = f"shard {self.topo.shard_index}: {first_line(exc)}"
        errors = sorted({e for e in federation.gather(error) if e})
        if errors:
            self.restore()
            return "; ".join(errors)
        if self.topo.rep_group is not None:
            for s in self.syncs:
                s.broadcast(self.topo.rep_group)
        step = federation.gather(step)[0]  # rank 0 (replica 0, shard 0) knows member 0's clock
        if (step, step) != (t.step_count, t.schedule_step):
            logger.info("caught up: step %d -> %d (member 0's clock)", t.step_count, step)
            t.step_count = step
            t.move_schedule(step)
        t.set_anchor()
        self.commit()
        return ""

    def adopt_mean(self) -> None:
        """The server path: the server's mean is in the shards; the rule steps on it, replicas receive it, and it is
        committed."""
        if self.replica0:
            for s in self.syncs:
                s.step_rule()  # the outer optimizer, on this rank's own shards and state
        if self.topo.rep_group is not None:
            for s in self.syncs:
                s.broadcast(self.topo.rep_group)
        self._after_sync()
        self.commit()

    # ----- checkpoints ------------------------------------------------------------------------------------
    def save_checkpoint(self, extra_meta: dict[str, Any] | None = None) -> None:
        """The trainer's checkpoint with this rank's token counts and global state (collective over the group)."""
        state: dict[str, Any] = {"fragment_tokens": list(self.tokens) if self.syncs else [0]}
        if self.syncs and self.syncs[0].keeps_global:
            state["outer"] = {"fragments": [s.state.state_dict() for s in self.syncs]}  # sharded like the parameters
        self.trainer.save_checkpoint(extra_meta, state)

    def resume(self) -> dict[str, Any]:
        """The trainer's newest usable checkpoint, with this rank's token counts and global state; returns its meta."""
        meta, rank_state = self.trainer.resume()
        if self.syncs:
            self.tokens = list(rank_state["fragment_tokens"])
        if "outer" in rank_state:
            saved = rank_state["outer"]["fragments"]
            if len(saved) != len(self.syncs):
                raise ValueError(f"outer state of {len(saved)} fragments, this sync has {len(self.syncs)}")
            for s, state in zip(self.syncs, saved):
                s.state.load_state_dict(state)
        return meta


__all__ = ["Federation", "PeriodPlan", "RunReport", "SyncFailed", "SyncLoop", "SyncObserver", "SyncOutcome",
           "at_fault"]
