"""One fragment's sync between two inner steps of a rank's `SyncLoop`: its weight (the group's tokens since its last
sync started), started (an overlapped sync) and merged (its reduction awaited, the members' agreement asked of the
loop's `Commits`), then adopted on every rank of the group (FL+HSDP's other replicas receive it by broadcast, the
optimizer state and the FedProx anchor follow) or dropped.

`FragmentSyncs` is the part of `SyncLoop` that does this; the loop owns the state it reads (the class's annotations
name it) and calls it where its schedule puts a merge or a start.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from flwr_sharded.errors import first_line
from flwr_sharded.parallel.admission import SyncRejected
from flwr_sharded.parallel.collectives import CollectiveTimeout
from flwr_sharded.parallel.schedule import Schedule
from flwr_sharded.parallel.sync import ShardSync
from flwr_sharded.parallel.token_weights import expected_weight_of
from flwr_sharded.training.commit import Commits
from flwr_sharded.training.federation import Federation, SyncOutcome, at_fault

if TYPE_CHECKING:
    from flwr_sharded.config import TrainConfig
    from flwr_sharded.training.observer import SyncObserver
    from flwr_sharded.training.trainer import Trainer


class FragmentSyncs:
    """A rank's fragment syncs started, merged and adopted (the base of `SyncLoop`, whose state this reads)."""

    trainer: Trainer
    topo: Any
    cfg: TrainConfig
    syncs: list[ShardSync]
    tokens: list[int]
    schedule: Schedule
    commits: Commits
    observers: list[SyncObserver]
    alpha: float
    reset_optimizer_state: bool
    A: int
    most_steps: int
    weight_world: int
    until: int | None
    _start_errors: dict[int, tuple[str, list[int], bool]]
    """An overlapped sync's failed start by fragment: (error, members at fault, a collective failed), for its merge."""
    steps: int
    replica0: bool

    def reference(self) -> float:
        """The run's clock at the current step (`SyncLoop.reference`)."""
        raise NotImplementedError

    def bind(self, federation: Federation) -> None:
        """Replica 0: every fragment's sync bound to the federation's groups, where it (re)joins them now."""
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
            self.bind(federation)
            self.syncs[i].start(self._take_weight(i), overlap=True, dense=self._dense(self.schedule.delay),
                                adopted=self.commits.adopted)
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
                self.bind(federation)
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
        errors = self.commits.agree(sync, federation, (error, blame, agreed), reached, outcome, broken)
        if errors:
            self.commits.restore()
            outcome.error = "; ".join(errors)
            return outcome
        self._adopt(i, federation, outcome)
        self.commits.commit(i)
        return outcome

    def _merge_overlapped(self, i: int, federation: Federation, apply_rule: bool) -> SyncOutcome:
        """The merge of fragment i's overlapped sync, started `sync-delay` steps ago: its reduction awaited, then one
        small all-reduce over this group (every rank's outcome, whether it must be undone at once, whether its
        admission confirmed the merges before, the members left out: `Commits.agree_overlapped`). No exchange with
        the other members: the merge is counted and its commit pending until their next exchange confirms it
        (`flwr_sharded.training.commit`). A failure that every member meets (a rejection, a broken collective, a
        failed start) puts every rank back at its last confirmed commit at once; one of this group alone
        (`SyncOutcome.deferred`) merges nothing and restores nothing: its count stays behind, and at their next
        exchange every member undoes the merges since the last confirmation together, at the same point of the
        schedule."""
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
        if not self.commits.agree_overlapped(sync, federation, (error, blame, broken), outcome, at_once=at_once,
                                             confirmed=confirmed, reached=reached):
            return outcome
        if self.replica0:
            outcome.stats = sync.merge()
            outcome.weight = outcome.stats.total_weight
        self._adopt(i, federation, outcome)
        self.commits.pend(i)
        return outcome

    def _adopt(self, i: int, federation: Federation, outcome: SyncOutcome) -> None:
        """Every rank takes in fragment i's adopted sync: FL+HSDP's replicas receive it, the optimizer state follows,
        and a member left out for non-finite values gets its moments back from the last commit."""
        if self.topo.rep_group is not None:
            self.syncs[i].broadcast(self.topo.rep_group)
        self.after_sync(i)
        if federation.member_index in outcome.left_out:
            self.commits.restore_optimizer(i)  # healed by the others' mean; its moments may hold the same NaN

    def after_sync(self, fragment: int | None = None) -> None:
        """What follows every adopted sync of a fragment (or of all) on every rank: the inner optimizer's state of
        its parameters cleared if configured, and the FedProx anchor set."""
        t = self.trainer
        params = None if fragment is None else self.syncs[fragment].params
        if self.reset_optimizer_state:
            for param in t.model.parameters() if params is None else params:
                t.optimizer.state.pop(param, None)
        t.set_anchor(params)

    def abandon(self, timeout: float = 5.0) -> None:
        """Drop the syncs in flight and restart every fragment's token count."""
        for s in self.syncs:
            s.abandon(timeout)
        self.tokens = [0] * len(self.tokens)
        self._start_errors.clear()


__all__ = ["FragmentSyncs"]
