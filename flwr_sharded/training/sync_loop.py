"""A rank's sync periods: the trainer's inner steps and the shard syncs of the model's fragments between them.

As torchft's DiLoCo owns sync, commit and rollback, `SyncLoop` owns everything around the inner steps: the schedule
(A, fragments, delay, alpha, carry), the clock of `group-steps speed`, each fragment's tokens (its weight), the
fragments' syncs (started, merged and adopted by its base, `flwr_sharded.training.fragment_sync.FragmentSyncs`), and
its `Commits` (`flwr_sharded.training.commit`: the members' agreement on each merge, a two-phase commit, and the
rollback of one that fails). `SyncLoop.run` is the one loop over periods: the static engine runs it until its last
step over its static federation (`static_run.StaticFederation`), a Flower round for the round's periods over the
round's members (`flwr_sharded.flower.group.round`, which also catches a member up: `training.catch_up`). What a run
goes over and reports (`Federation`, `SyncOutcome`, `PeriodPlan`, `RunReport`) is `training.federation`'s.

What watches the loop (the traffic probe, a bench's slowed group, a test's faults) is a `SyncObserver` in
`loop.observers` (`flwr_sharded.training.observer`), called where the loop does what it names.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial
from typing import Any, Callable

import torch

from flwr_sharded import host_memory
from flwr_sharded.parallel.schedule import Schedule, fragment_parameters, local_steps
from flwr_sharded.parallel.flight import Snapshot
from flwr_sharded.parallel.sync import ShardSync
from flwr_sharded.parallel.token_weights import tokens_of
from flwr_sharded.parallel.wire import sync_wire
from flwr_sharded.training.commit import Commits
from flwr_sharded.training.federation import Federation, PeriodPlan, RunReport, SyncOutcome
from flwr_sharded.training.fragment_sync import FragmentSyncs
from flwr_sharded.training.models import transformer_blocks
from flwr_sharded.training.observer import SyncObserver, observers_for
from flwr_sharded.training.trainer import Trainer
from flwr_sharded.validation import outer_rule


class SyncLoop(FragmentSyncs):
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
            wire = partial(sync_wire, p.sync_dtype, p.sync_topk, p.sync_topk_merge, p.sync_error_decay,
                           restart=p.sync_restart == "residual")  # one per sync: a top-k wire keeps its merge's rows
            self.syncs = [ShardSync(part, fed_group=None, bucket_bytes=int(p.bucket_mb * (1 << 20)),
                                    rule=outer_rule(p), wire=wire(), error_feedback=p.sync_error_feedback,
                                    max_move=p.sync_max_move, seat=topo.seat, snapshot=snapshot, origin=origin,
                                    carry=p.carries)
                          for part in fragment_parameters(model, transformer_blocks(model), p.sync_fragments)]
        self.tokens = [0] * len(self.syncs)
        """This rank's tokens since each fragment's last sync started (its weight in the next one)."""
        self.tokens_trained = 0
        """Tokens every group together trained in the periods whose times were exchanged."""
        self.commits = Commits(topo, self.abandon)
        """The members' agreement on each merge, the rollback point and the merges adopted and confirmed."""
        self.period_start = self.clock_start = 0
        self.compute_s = 0.0
        """Seconds of inner steps in the current period (its step time, `Federation.period_times`)."""
        self.report = RunReport()
        """What the current (or last) `run` did."""
        self._start_errors: dict[int, tuple[str, list[int], bool]] = {}
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
                self.commits.commit()  # the rollback point holds the global state in the new seat's buckets
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
        self.until, self.commits.adopted, self.commits.confirmed, self._failures = until, 0, 0, 0
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
        host_memory.after_period()
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

    # ----- the commits: a run's confirmation, the rollback point ----------------------------------------------
    def confirm_merges(self, federation: Federation | None) -> SyncOutcome:
        """Every member confirms the overlapped syncs' merges no later admission confirmed (a run's end, before a
        checkpoint; `Commits.confirm_merges`). Where a member is behind, every rank goes back to its last confirmed
        commit; the outcome says why. Nothing to do for blocking syncs, whose merges are committed at once."""
        outcome = SyncOutcome(fragment=self.schedule.fragments - 1)
        if federation is None or not self.schedule.delay or not self.syncs:
            return outcome
        return self.commits.confirm_merges(federation, outcome)

    def keep_rollback_point(self) -> None:
        """Keep a host copy of the last adopted sync from now on (what a restore returns to), committed now."""
        self.commits.keep([(s.params, s.state) for s in self.syncs], self.trainer.optimizer, clock=self._clock,
                          set_clock=self._set_clock)

    def _clock(self) -> dict[str, Any]:
        """The trainer's clock and where its period started (a commit at a period's end: the next one)."""
        step = self.trainer.step_count
        return {**self.trainer.clock(),
                "period_start": step if step - self.period_start >= self.steps else self.period_start}

    def _set_clock(self, state: dict[str, Any]) -> None:
        self.trainer.set_clock(state)
        self.period_start = state["period_start"]

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


__all__ = ["SyncLoop"]
