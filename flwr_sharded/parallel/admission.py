"""Which groups a decentralised sync admits, and the votes that adopt its result.

- `admit` (one all-gather of (weight, healthy) over the federation group: every member admits the same set): a member
  contributes only if its weight is finite and in (0, `max_weight`] (steps x tokens per step x a group's ranks: the
  most tokens it can have trained on) and all it would send is finite. Each shard index decides alone, and every
  group still ends equal: a member left out sends zeros and receives the others' mean, which heals it.
- `vote` (MIN over the federation group): the result is adopted only if finite and plausible on every member
  (`flwr_sharded.parallel.plausibility`). Inside an all-reduce nobody sees another's values, so a peer that lies about
  itself makes all roll back. The vote agrees on the first bucket any member rejected, where
  `flwr_sharded.parallel.offender` looks for the culprit (the server path, which sees each facility's values,
  excludes that facility instead: `flwr_sharded.flower.server.aggregation`).
- `commit_vote` (the second phase of a blocking sync's commit): adopted only if every member, replicas included,
  finished its part; otherwise all roll back at once instead of diverging.
- An overlapped sync has no commit vote of its own: each member brings the count of merges its group adopted to the
  next sync's admission (or to `confirm` where no sync follows: a run's end, a checkpoint). Equal counts confirm
  every merge since the last confirmation; a member behind the others makes every member roll back
  (`flwr_sharded.training.commit` and `docs/flower.md` give the argument).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flwr_sharded.parallel.collectives import bounded
from flwr_sharded.parallel.token_weights import weight_verdict
from flwr_sharded.parallel.torch_compat import all_gather_single
from flwr_sharded.parallel.verdict import NOT_FINITE, Verdict

log = logging.getLogger(__name__)

ADMISSION_BYTES = 24
"""What each member contributes to `admit`'s all-gather: its weight, verdict and adopted merges, three float64."""
VOTE_BYTES = 8
"""What a member sends in `vote`'s all-reduce: two float32 (its verdict, the first bucket it rejected)."""
NO_BUCKET = float(1 << 24)
"""`vote`'s bucket when a member rejected none (float32 holds every integer below it)."""
COMMIT_BYTES = 4
"""What a member contributes to `commit_vote`'s all-gather: one float32."""
CONFIRM_BYTES = 8
"""What a member contributes to `confirm`'s all-gather: its adopted merges, one float64."""


class SyncRejected(RuntimeError):
    """A sync that must not be adopted: no member may contribute, or its result is not finite and plausible on every
    member. `bucket`: the first bucket a member rejected (None: none named one); `offenders`: the members found at
    fault in it (indices in the federation group; `flwr_sharded.parallel.offender`)."""

    def __init__(self, message: str, bucket: int | None = None, offenders: list[int] | None = None) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.offenders = list(offenders or [])


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite, through their sums: one read, no tensor-sized temporary (a sum
    that overflows counts as not finite, as it would in a mean)."""
    sums = [t.sum(dtype=torch.float32) for t in tensors if t.numel()]
    return not sums or bool(torch.isfinite(torch.stack(sums).sum()))


def healthy(tensors: list[torch.Tensor], weight: float, max_weight: float | None,
            norms: list[float] | None = None) -> bool:
    """This member's verdict on itself: `weight` in bounds and `tensors` (what it would send) finite. `norms`, when
    measured: finite norms prove finite values (an infinite one may be overflow: then the values are summed)."""
    if weight_verdict(None, weight, at_most=max_weight) is not None:
        return False
    return (norms is not None and all(n < float("inf") for n in norms)) or all_finite(tensors)


@dataclass(frozen=True)
class Admission:
    """The members' weights as admitted: 0 for a member left out."""

    weights: list[float]
    me: int
    """This rank's index in the federation group."""
    verdicts: tuple[Verdict, ...] = ()
    """Why each member left out is (`Verdict.member`: its index in the federation group)."""
    adopted: tuple[int, ...] = ()
    """Each member's count of adopted merges, as it brought it (see `behind`)."""

    @property
    def total(self) -> float:
        return sum(self.weights)

    @property
    def mine(self) -> float:
        """This member's admitted weight (0: it sends zeros)."""
        return self.weights[self.me]

    @property
    def left_out(self) -> list[int]:
        """The members (indices in the federation group) left out of this sync."""
        return [j for j, w in enumerate(self.weights) if w == 0]


def behind(adopted: list[int] | tuple[int, ...]) -> list[int]:
    """The members (indices) whose count of adopted merges is below another's: they did not adopt a merge the others
    kept, so no member may keep it."""
    return [j for j, n in enumerate(adopted) if n < max(adopted)]


def admit(weight: float, ok: bool, max_weight: float | None, fed_group: dist.ProcessGroup,
          device: torch.device, adopted: int = 0) -> Admission:
    """Admit the members healthy and in bounds, the same set everywhere (one all-gather over `fed_group`, which also
    carries each member's count of `adopted` merges); each one left out is logged by itself and by global rank 0.
    `SyncRejected` if none is left."""
    size = dist.get_world_size(fed_group)
    mine = torch.tensor([weight, 1.0 if ok else 0.0, adopted], dtype=torch.float64, device=device)  # ADMISSION_BYTES
    gathered = torch.empty(size * 3, dtype=torch.float64, device=device)
    bounded(all_gather_single, gathered, mine, group=fed_group)
    weights, verdicts, me, speak = [], [], dist.get_rank(fed_group), dist.get_rank() == 0
    rows = gathered.view(size, 3).tolist()
    for j, (w, ok, _) in enumerate(rows):
        verdict = weight_verdict(j, w, at_most=max_weight) or (
            None if ok == 1.0 else Verdict(j, "its values are not finite", NOT_FINITE))
        if verdict is not None:
            if speak or j == me:
                log.warning("flwr_sharded: sync: member %d of the federation group is left out of this sync: %s",
                            j, verdict.reason)
            verdicts.append(verdict)
            w = 0.0
        weights.append(w)
    admission = Admission(weights=weights, me=me, verdicts=tuple(verdicts), adopted=tuple(int(n) for *_, n in rows))
    if not admission.total > 0:
        raise SyncRejected("no member of the federation group may contribute to this sync (see the log lines)")
    return admission


def vote(result_ok: bool, fed_group: dist.ProcessGroup | None, device: torch.device,
         first_bad: int | None = None) -> None:
    """Adopt the result only if finite and plausible on every member (one all-reduce MIN over `fed_group` of the
    verdicts and `first_bad`, the first bucket rejected); else `SyncRejected` everywhere, naming that bucket."""
    bucket = NO_BUCKET if first_bad is None else float(first_bad)
    flag = torch.tensor([1.0 if result_ok else 0.0, bucket], dtype=torch.float32, device=device)  # VOTE_BYTES
    if fed_group is not None:
        bounded(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=fed_group)
    ok, bucket = flag.tolist()
    if ok != 1.0:
        raise SyncRejected("the sync's result is not finite or not plausible on some member (a member sent NaN, "
                           "infinity, values that overflow or values that move the model by more than "
                           "sync-max-move allows): it is not adopted", bucket=None if bucket >= NO_BUCKET else
                           int(bucket))


def commit_vote(succeeded: bool, fed_group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Phase two of a sync (one all-gather over `fed_group`): the members (indices in the group) whose part failed,
    the same list everywhere; the sync is adopted only if it is empty. Unreachable peers raise (the group's
    timeout bounds the wait)."""
    size = dist.get_world_size(fed_group)
    mine = torch.tensor([1.0 if succeeded else 0.0], dtype=torch.float32, device=device)  # COMMIT_BYTES
    gathered = torch.empty(size, dtype=torch.float32, device=device)
    bounded(all_gather_single, gathered, mine, group=fed_group)
    return [j for j, flag in enumerate(gathered.tolist()) if flag != 1.0]


def confirm(adopted: int, fed_group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """The members (indices in the group) `behind` the others in adopted merges (one all-gather over `fed_group`),
    the same list everywhere: the merges since the last confirmation stand only if it is empty (where no sync's
    admission follows them: a run's end, a checkpoint)."""
    size = dist.get_world_size(fed_group)
    mine = torch.tensor([adopted], dtype=torch.float64, device=device)  # CONFIRM_BYTES
    gathered = torch.empty(size, dtype=torch.float64, device=device)
    bounded(all_gather_single, gathered, mine, group=fed_group)
    return behind([int(n) for n in gathered.tolist()])


__all__ = ["ADMISSION_BYTES", "COMMIT_BYTES", "CONFIRM_BYTES", "NO_BUCKET", "VOTE_BYTES", "Admission",
           "SyncRejected", "admit", "all_finite", "behind", "commit_vote", "confirm", "healthy", "vote"]
