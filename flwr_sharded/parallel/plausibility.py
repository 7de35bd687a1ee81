"""Whether a sync's result is plausible where it arrives: the move it makes to each bucket of a rank's shards.

Every member's own verdict (`flwr_sharded.parallel.admission`) says whether its weight and values are sound, but a
member may lie about itself, and inside an all-reduce nobody sees another's values. What every rank can check is
the result against its own contribution: bucket k of the groups' mean moves this rank's values by

    move_k = || mean_k - contribution_k ||_2

For honest members that move grows with the local steps behind it and changes slowly from one sync to the next; a
member that sends 1e30 (or any values far from the others') makes it explode. So each adopted move is kept per
token of this member's weight (its tokens since the last sync: a longer period moves more), and a result is
plausible on a rank if every bucket's move is finite and at most `max_move` x the median of that bucket's last
`MOVE_HISTORY` adopted moves per token x this sync's weight (before a bucket has one: `max_move` x
|| contribution_k ||, the bucket's own norm; a bucket of zeros with no history is not bounded). Moves below
`NEGLIGIBLE_MOVE` x the bucket's norm (groups that had not diverged: rounding) are not kept. One norm of a difference
per bucket (in chunks through one 4 MiB scratch buffer), no copy kept; the result is adopted only if it is plausible on every rank of every member (the sync's
vote), and a rejected one names its offender where one member alone explains it (`flwr_sharded.parallel.offender`).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a check runs: the config reads the default without it
    import torch

DEFAULT_MAX_MOVE = 10.0
"""`sync-max-move`'s default: a sync may move a bucket by at most 10x its recent moves."""
MOVE_HISTORY = 8
"""Adopted moves per bucket whose median is a bucket's reference."""
NEGLIGIBLE_MOVE = 1e-5
"""A move below this fraction of the bucket's norm is rounding, not training: it is not kept as a reference."""


CHUNK = 1 << 20
"""Elements a move is measured over at a time: its one scratch buffer (4 MiB in fp32), no temporary a bucket's size."""


def move_and_norm(means: list[torch.Tensor], contribution: list[torch.Tensor],
                  scratch: torch.Tensor | None = None) -> tuple[float, float]:
    """(|| means - contribution ||_2, || contribution ||_2) over the segments of one bucket, chunk by chunk through
    `scratch` (at least `CHUNK` elements of the means' dtype and device; made if None); the move is inf or NaN when
    the means are not finite. One read of each, one host transfer."""
    import torch

    if scratch is None:
        scratch = torch.empty(CHUNK, dtype=means[0].dtype, device=means[0].device)
    moves, norms = [], []
    for m, c in zip(means, contribution):
        m, c = m.reshape(-1), c.reshape(-1)
        for start in range(0, m.numel(), CHUNK):
            part = c[start:start + CHUNK]
            diff = torch.sub(m[start:start + CHUNK], part, out=scratch[:part.numel()])
            moves.append(torch.linalg.vector_norm(diff, dtype=torch.float32))
            norms.append(torch.linalg.vector_norm(part, dtype=torch.float32))
    if not moves:
        return 0.0, 0.0
    move, norm = torch.linalg.vector_norm(torch.stack([torch.stack(moves), torch.stack(norms)]), dim=1).tolist()
    return move, norm


class MoveBound:
    """One sync's bound on the move of each of its buckets, and the moves it adopted (this rank's history, per token
    of its weight).

    Args:
        max_move: `sync-max-move`; 0 turns the check off (then only finiteness is checked, as the vote always does).
    """

    def __init__(self, max_move: float = DEFAULT_MAX_MOVE) -> None:
        if not max_move >= 0:
            raise ValueError(f"max_move must be >= 0, got {max_move}")
        self.max_move = max_move
        self.weight = 1.0
        """This member's weight in the sync being checked (`begin`)."""
        self._history: dict[int, deque[float]] = {}
        self._pending: dict[int, float] = {}
        self._scratch: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        return self.max_move > 0

    def begin(self, weight: float) -> None:
        """A sync of this member's `weight` (its tokens since the last one) is checked next."""
        self.weight = weight
        self._pending.clear()

    def bound(self, k: int, norm: float) -> float:
        """The largest move bucket k may make to this rank's values of it (of norm `norm`); unbounded while the
        bucket has neither a move nor a norm above zero to scale it."""
        history = self._history.get(k)
        reference = statistics.median(history) * self.weight if history else norm
        return self.max_move * reference if reference > 0 else float("inf")

    def plausible(self, k: int, means: list[torch.Tensor], contribution: list[torch.Tensor]) -> bool:
        """Whether the groups' mean of bucket k (`means`, laid out as `contribution`) is plausible here; its move is
        kept for `record`. A rank whose own values are not finite cannot judge: it says yes (the others judge)."""
        from flwr_sharded.parallel.admission import all_finite

        move, norm = move_and_norm(means, contribution, self._scratch_for(means[0]))
        if not (norm < float("inf")) and not all_finite(contribution):
            return True  # this rank's own values are not finite (an inf norm may only be finite values' overflow)
        if not (move < float("inf")):
            return False
        ok = move <= self.bound(k, norm)
        if ok and move > NEGLIGIBLE_MOVE * norm:
            self._pending[k] = move / self.weight
        return ok

    def within(self, k: int, candidate: list[torch.Tensor], contribution: list[torch.Tensor]) -> bool:
        """Whether a candidate mean of bucket k would be plausible here (the offender's search); records nothing."""
        move, norm = move_and_norm(candidate, contribution)
        return move == move and move <= self.bound(k, norm)

    def _scratch_for(self, like: torch.Tensor) -> torch.Tensor:
        import torch

        if self._scratch is None or self._scratch.dtype != like.dtype or self._scratch.device != like.device:
            self._scratch = torch.empty(CHUNK, dtype=like.dtype, device=like.device)
        return self._scratch

    def record(self) -> None:
        """The moves of the sync just adopted (every bucket's, as `plausible` measured them) join the history."""
        for k, move in self._pending.items():
            self._history.setdefault(k, deque(maxlen=MOVE_HISTORY)).append(move)
        self._pending.clear()

    def discard(self) -> None:
        """Forget the moves of a sync that was not adopted."""
        self._pending.clear()


__all__ = ["CHUNK", "DEFAULT_MAX_MOVE", "MOVE_HISTORY", "NEGLIGIBLE_MOVE", "MoveBound", "move_and_norm"]
