"""A rank's commits: the members' agreement on each fragment sync (a two-phase commit), the rollback point it returns
to when one fails, and the count of merges adopted and confirmed. As torchft's DiLoCo keeps sync, commit and rollback
together, `SyncLoop` holds one `Commits` and asks it at each merge. A sync is adopted only when every rank of every
member succeeded:

- phase one: replica 0 of each shard index runs its part of the sync; the group's ranks learn each other's outcome
  (`Federation.flags`, one small all-reduce inside the group);
- phase two, a blocking sync: each replica 0 tells the members whether its whole group succeeded (`commit_vote`);
- phase two, an overlapped sync: nothing at the merge. The group merges, keeps the commit pending and counts the
  merge; its count travels in the members' next exchange (the next sync's admission, on the communication thread,
  or `confirm_merges` at a run's end and before a checkpoint). Equal counts confirm every pending commit; a member
  behind makes every member reject that sync and return to the last confirmed commit. The training thread so waits
  for the other members only for the data of a sync, never for a vote.

A sync that fails anywhere puts every rank of every member back at its last (confirmed) commit
(`RollbackPoint.restore`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from flwr_sharded.errors import first_line
from flwr_sharded.parallel.admission import commit_vote
from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.parallel.global_state import GlobalState
from flwr_sharded.parallel.rollback import RollbackPoint
from flwr_sharded.parallel.sync import ShardSync
from flwr_sharded.training.federation import Federation, SyncOutcome

logger = logging.getLogger(__name__)


class Commits:
    """One rank's commit protocol over its fragments' syncs: what a failed sync returns to and how every member
    agrees that one stands.

    `topo`: the rank's topology (its shard index names this rank's errors); `abandon` drops the rank's syncs in
    flight and restarts their token counts (`FragmentSyncs.abandon`), the first step of a restore."""

    def __init__(self, topo: Any, abandon: Callable[[], None]) -> None:
        self.topo = topo
        self._abandon = abandon
        self.point: RollbackPoint | None = None
        """The last adopted sync (`keep`); None: a failed sync cannot be undone on this rank."""
        self.adopted = 0
        """Merges of overlapped syncs this group adopted in the current run (brought to the next admission)."""
        self.confirmed = 0
        """`adopted` as of the last confirmation (what a rollback returns it to)."""

    # ----- the rollback point -----------------------------------------------------------------------------
    def keep(self, parts: Sequence[tuple[Sequence[torch.Tensor], GlobalState | None]],
             optimizer: torch.optim.Optimizer, *, clock: Callable[[], dict[str, Any]],
             set_clock: Callable[[dict[str, Any]], None]) -> None:
        """Keep a host copy of the last adopted sync from now on (what `restore` returns to), committed now."""
        if self.point is None:
            self.point = RollbackPoint(parts, optimizer, clock=clock, set_clock=set_clock)
        self.point.commit()

    def commit(self, fragment: int | None = None) -> None:
        """The current state (of one fragment, or all) is what a failed sync returns to (of all: every merge stands,
        pending or not)."""
        if self.point is not None:
            self.point.commit(fragment)
        if fragment is None:
            self.confirmed = self.adopted

    def pend(self, fragment: int) -> None:
        """An overlapped sync's merge of `fragment` was adopted: its commit is pending until the members confirm it."""
        if self.point is not None:
            self.point.commit(fragment, pending=True)
        self.adopted += 1

    def confirm(self) -> None:
        """The pending commits stand: every member adopted the merges they hold."""
        if self.point is not None:
            self.point.confirm()
        self.confirmed = self.adopted

    def restore(self, *, keep_pending: bool = False) -> None:
        """Every fragment back at its last commit, the step and schedule at the newest one; no sync in flight.
        `keep_pending`: the merges this group adopted since the last confirmation stand too (a collective broke:
        a member is lost, and what it adopted cannot be learnt; the members still there kept the same merges unless
        one of them lost one alone, which a Flower round's checksums and catch-up repair)."""
        if keep_pending:
            self.confirm()
        self._abandon()
        if self.point is not None:
            self.point.restore()
        self.adopted = self.confirmed

    def restore_optimizer(self, fragment: int) -> None:
        """Fragment's optimizer moments back at the last commit (where there is one)."""
        if self.point is not None:
            self.point.restore_optimizer(fragment)

    # ----- the members' agreement -------------------------------------------------------------------------
    def agree(self, sync: ShardSync, federation: Federation, mine: tuple[str, list[int], bool], reached: bool,
              outcome: SyncOutcome, broken: bool = False) -> list[str]:
        """A blocking sync's two phases: every error any rank of any member saw; fills the outcome's blame and
        left-out members. `mine`: this rank's (error, members at fault, whether the error is a rejection every member
        reached; `broken`: this rank's own collective failed, `outcome.collective_failed` says if any did). When
        nothing went wrong each phase is one small all-reduce over the group. A group where a rank's collective
        failed inside the reduction does not vote: some member of that reduction is stopped, gone or late and will
        not vote either, so a vote would wait out the sync timeout a second time (and the group adopts nothing
        whatever it says)."""
        error, blame, _ = mine
        phase_one = [mine]
        failed, any_broken, cut = federation.flags([int(bool(error or blame)), int(broken),
                                                    int(broken and not reached)])
        outcome.collective_failed = bool(any_broken)
        if failed:
            phase_one = federation.gather(mine)
        errors = sorted({e for e, _, _ in phase_one if e})
        own = [e for e, _, agreed in phase_one if e and not agreed]  # a rejection all members reached is nobody's
        vote_error, noes = "", []
        group = federation.vote_group() if reached and not cut else None
        if group is not None:
            try:
                noes = commit_vote(not own, group, local_shard(sync.params[0]).device)
            except Exception as exc:  # noqa: BLE001 - a member gone between the phases
                vote_error = f"shard {self.topo.shard_index}: commit vote: {first_line(exc)}"
        left_out = sync.left_out if reached else []
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

    def agree_overlapped(self, sync: ShardSync, federation: Federation, mine: tuple[str, list[int], bool],
                         outcome: SyncOutcome, *, at_once: bool, confirmed: bool, reached: bool) -> bool:
        """An overlapped sync's merge, inside the group only: one small all-reduce of every rank's outcome, whether
        it must be undone at once, whether its admission confirmed the merges before (they are then confirmed), and
        the members left out. True: the merge stands (pending); else the outcome says why, and either every rank is
        back at its last confirmed commit (a failure every member meets) or, a failure of this group alone, nothing
        is merged or restored (`SyncOutcome.deferred`). `mine`: this rank's (error, members at fault, whether its
        own collective failed)."""
        error, blame, broken = mine
        mask = [int(j in sync.left_out) if reached else 0 for j in range(federation.members)]
        failed, any_broken, any_at_once, unconfirmed, *left_out = federation.flags(
            [int(bool(error or blame)), int(broken), int(at_once), int(not confirmed), *mask])
        outcome.collective_failed = bool(any_broken)
        if not unconfirmed:  # every member adopted every merge before this sync
            self.confirm()
        if not failed:
            outcome.left_out = [j for j, out in enumerate(left_out) if out]
            return True
        self.learn_failure(federation, (error, blame), outcome)
        if any_at_once:
            self.restore(keep_pending=bool(any_broken))
        else:
            sync.abandon()
            outcome.deferred = True
            logger.warning("fragment %d's sync failed in this group alone (%s): not merged; every member undoes "
                           "the merges since the last confirmation at their next exchange", outcome.fragment,
                           outcome.error)
        return False

    def confirm_merges(self, federation: Federation, outcome: SyncOutcome) -> SyncOutcome:
        """Every member confirms the overlapped syncs' merges no later admission confirmed: one exchange of their
        counts between the members (`Federation.behind`), one small all-reduce inside the group. Where a member is
        behind, every rank goes back to its last confirmed commit; `outcome` says why."""
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
            self.confirm()
            return outcome
        self.learn_failure(federation, (error, blame), outcome)
        self.restore(keep_pending=bool(any_broken))
        return outcome

    @staticmethod
    def learn_failure(federation: Federation, mine: tuple[str, list[int]], outcome: SyncOutcome) -> None:
        """Every rank of the group's (error, members at fault) into `outcome` (collective over the group)."""
        phase_one = federation.gather(mine)
        outcome.error = "; ".join(sorted({e for e, _ in phase_one if e}))
        outcome.blame = sorted({j for _, js in phase_one for j in js})


__all__ = ["Commits"]
