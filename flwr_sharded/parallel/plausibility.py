"""Whether a sync's result is plausible where it arrives: the move it makes to each bucket of a rank's shards.

Nobody sees another's values inside an all-reduce, but each rank can check the result against its own contribution
(its shards hold it until the result is adopted): move_k = || mean_k - contribution_k ||_2. Honest moves grow with the
local steps and change slowly; a member sending 1e30 or far-off values makes them explode. With `allowed` = `max_move`
x median(bucket k's last `MOVE_HISTORY` adopted moves per token) x this sync's weight (its tokens since the last sync;
without history, `max_move` x || contribution_k ||), a result is plausible if for every bucket:

- | ||mean_k|| - ||contribution_k|| | <= `allowed`: exact norms, a lower bound of the move that catches any huge value,
  however sparse;
- move_k <= `allowed`: exact below `EXACT_BELOW` elements, else measured on one `BLOCK` in `SAMPLE` at an offset each
  rank draws per sync and never sends (no sender can aim between them) and scaled up. The sample overstates a move
  only when one block holds most of it (over 86% of the squared move for a false rejection at `max_move` 10).

Sampling keeps the check at a few percent of a memory-bound sync (CPU, loopback); the offender search measures exact
moves. Moves below `NEGLIGIBLE_MOVE` x the contribution's norm (rounding) are not kept; a bucket of zeros with no
history is unbounded.
"""

from __future__ import annotations

import os
import random
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
"""A move below this fraction of the contribution's norm is rounding, not training: it is not kept as a reference."""
BLOCK = 1 << 12
"""Elements of one sampled block of a move (16 KiB in fp32)."""
SAMPLE = 16
"""One block in this many is measured for a move, in a bucket of `EXACT_BELOW` elements or more."""
EXACT_BELOW = 64 * SAMPLE * BLOCK
"""Buckets with fewer elements (a sample of fewer than 64 blocks) have their move measured exactly."""
ROWS = 64
"""Blocks of a move measured in one operation (a 1 MiB temporary in fp32)."""


def norm_of(tensors: list[torch.Tensor]) -> float:
    """|| tensors ||_2 (NaN or inf when they are not finite, or too large for their dtype)."""
    import torch

    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))))


def bucket_norms(buckets: list[list[torch.Tensor]]) -> list[float]:
    """|| bucket ||_2 of each bucket (a list of segments): one pass over every segment and one host sync in all."""
    import torch

    segments = [t for bucket in buckets for t in bucket]
    if not segments:
        return [0.0] * len(buckets)
    norms, out, i = torch._foreach_norm(segments), [], 0
    zero = norms[0].new_zeros(())
    for bucket in buckets:
        out.append(torch.linalg.vector_norm(torch.stack(norms[i:i + len(bucket)])) if bucket else zero)
        i += len(bucket)
    return torch.stack(out).tolist()


def _blocks(means: list[torch.Tensor], contribution: list[torch.Tensor], *, every: int,
            offset: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Views of the bucket's blocks j (of `BLOCK` elements, counted across its segments in order) with j % every ==
    offset, in `means` and in `contribution` alike: whole blocks `ROWS` at a time (strided views), and the blocks cut
    by a segment's edge."""
    ours, theirs, position, stride = [], [], 0, every * BLOCK
    for m, c in zip(means, contribution):
        m, c, n = m.reshape(-1), c.reshape(-1), m.numel()
        block = position // BLOCK
        block += (offset - block) % every  # the first sampled block that reaches this segment
        while block * BLOCK < position + n:
            start = block * BLOCK - position
            if start < 0 or start + BLOCK > n:  # a block cut by the segment's edge
                ours.append(m[max(start, 0):start + BLOCK])
                theirs.append(c[max(start, 0):start + BLOCK])
                block += every
                continue
            whole = (n - start - BLOCK) // stride + 1  # sampled blocks inside the segment from here
            for first in range(0, whole, ROWS):
                rows = min(ROWS, whole - first)
                lo, span = start + first * stride, (rows - 1) * stride + BLOCK
                ours.append(m[lo:lo + span].unfold(0, BLOCK, stride))
                theirs.append(c[lo:lo + span].unfold(0, BLOCK, stride))
            block += whole * every
        position += n
    return ours, theirs


def _distance(ours: list[torch.Tensor], theirs: list[torch.Tensor], every: int) -> float:
    """|| ours - theirs ||_2 x sqrt(every): one foreach difference and norm (a temporary of 1/every of a bucket)."""
    return float(_unscaled_distance(ours, theirs)) * every ** 0.5


def _unscaled_distance(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> torch.Tensor | float:
    """|| ours - theirs ||_2, on their device (no host sync); 0.0 for no blocks."""
    import torch

    if not ours:
        return 0.0
    differences = torch._foreach_sub([m.float() for m in ours], [c.float() for c in theirs])
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(differences)))


def _move(means: list[torch.Tensor], contribution: list[torch.Tensor], *, every: int, offset: int) -> float:
    """|| means - contribution ||_2 over the bucket's blocks j with j % every == offset (`_blocks`), scaled by
    sqrt(every): exact for every = 1, else an unbiased estimate of its square from 1/every of the elements."""
    return _distance(*_blocks(means, contribution, every=every, offset=offset), every)


class MoveBound:
    """One sync's bound on the move of each of its buckets, and what it adopted (this rank's history).

    Args:
        max_move: `sync-max-move`; 0 turns the check off (then only finiteness is checked, as the vote always does).
    """

    def __init__(self, max_move: float = DEFAULT_MAX_MOVE) -> None:
        if not max_move >= 0:
            raise ValueError(f"max_move must be >= 0, got {max_move}")
        self.max_move = max_move
        self.weight = 1.0
        """This member's weight in the sync being checked (`begin`)."""
        self.judges = True
        """Whether this member can judge the sync being checked (its own values were sound)."""
        self._moves: dict[int, deque[float]] = {}
        self._pending: dict[int, float] = {}
        self._own: list[float] | None = None
        self._samples: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], dict[int, tuple[list, list]]]] = {}
        """Per bucket: the segment lists it was checked on, and per offset the views of their sampled blocks."""
        self._offsets = random.Random(os.urandom(16))

    @property
    def enabled(self) -> bool:
        return self.max_move > 0

    def begin(self, weight: float, judges: bool = True, own_norms: list[float] | None = None) -> None:
        """Check a sync of this member's `weight` (tokens since the last one) next. `judges`: its verdict on its own
        values (unsound ones cannot judge the mean: it says yes); `own_norms`: its bucket norms (`bucket_norms`) if
        measured before the reduction (else `plausible` measures them)."""
        self.weight, self.judges, self._own = weight, judges, own_norms
        self._pending.clear()

    def allowed(self, k: int, own_norm: float) -> float:
        """The largest move (and change of norm) of bucket k this sync, from its adopted moves or else its own norm;
        unbounded while nothing above zero scales it."""
        history = self._moves.get(k)
        reference = statistics.median(history) * self.weight if history else own_norm
        return self.max_move * reference if reference > 0 else float("inf")

    def plausible(self, k: int, means: list[torch.Tensor], contribution: list[torch.Tensor],
                  whole: torch.Tensor | None = None) -> bool:
        """Whether the mean of bucket k (`means`, laid out as `contribution`, this rank's values) is plausible here;
        its move is kept for `record`. `whole`: the flat bucket holding exactly `means` (one contiguous pass)."""
        import torch

        from flwr_sharded.parallel.admission import all_finite

        if not self.judges:
            return True
        measured, read = self._own is None, [whole] if whole is not None else means
        norms = torch._foreach_norm([*read, *contribution] if measured else read)  # one pass over each
        every = 1 if sum(m.numel() for m in means) < EXACT_BELOW else SAMPLE
        # the mean's norm, this rank's and the move, read to the host at once: one host sync per bucket
        figures = [torch.linalg.vector_norm(torch.stack(norms[:len(read)]))]
        if measured:
            figures.append(torch.linalg.vector_norm(torch.stack(norms[len(read):])))
        distance = _unscaled_distance(*self._sample(k, means, contribution, every))
        if isinstance(distance, torch.Tensor):
            figures.append(distance.to(figures[0].device))
        read_back = torch.stack(figures).tolist()
        norm, own = read_back[0], read_back[1] if measured else self._own[k]
        move = (read_back[-1] if isinstance(distance, torch.Tensor) else distance) * every ** 0.5
        if not norm < float("inf"):
            return False
        if not own < float("inf") and not all_finite(contribution):
            return True  # its own values are not finite: it cannot judge (an inf norm may be finite values' overflow)
        allowed = self.allowed(k, own)
        ok = abs(norm - own) <= allowed and move <= allowed  # |‖a‖ - ‖b‖| <= ‖a - b‖: exact, every element
        if ok and move > NEGLIGIBLE_MOVE * own:
            self._pending[k] = move / self.weight
        return ok

    def _sample(self, k: int, means: list[torch.Tensor], contribution: list[torch.Tensor],
                every: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of bucket k's blocks at an offset drawn for this sync (`_blocks`), cached per bucket and offset
        while its segment lists stay the same objects (a sync reuses its buffer views)."""
        offset = self._offsets.randrange(every)
        known = self._samples.get(k)
        if known is None or known[0] is not means or known[1] is not contribution:
            known = self._samples[k] = (means, contribution, {})
        if offset not in known[2]:
            known[2][offset] = _blocks(means, contribution, every=every, offset=offset)
        return known[2][offset]

    def within(self, k: int, candidate: list[torch.Tensor], contribution: list[torch.Tensor],
               own_norm: float) -> bool:
        """Whether a candidate mean of bucket k moves this rank's values within bounds, exactly; records nothing."""
        move = _move(candidate, contribution, every=1, offset=0)
        return move == move and move <= self.allowed(k, own_norm)

    def record(self) -> None:
        """What the sync just adopted moved (every bucket's, as `plausible` measured it) joins the history."""
        for k, move in self._pending.items():
            self._moves.setdefault(k, deque(maxlen=MOVE_HISTORY)).append(move)
        self._pending.clear()

    def discard(self) -> None:
        """Forget what a sync that was not adopted moved."""
        self._pending.clear()


__all__ = ["BLOCK", "DEFAULT_MAX_MOVE", "EXACT_BELOW", "MOVE_HISTORY", "NEGLIGIBLE_MOVE", "SAMPLE", "MoveBound",
           "bucket_norms", "norm_of"]
