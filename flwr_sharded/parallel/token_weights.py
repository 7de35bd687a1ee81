"""What a contribution to a sync should weigh, and whether a reported weight is that.

Weights are tokens: after `steps` optimizer steps since its last sync, a group of `world` ranks weighs

    steps x batch_size x grad_accum x seq_len x world

(the data stream always yields full batches); a server-path facility weighs its members' sum over the round's K syncs
of A steps (`steps` = K x A). Whoever coordinates knows every factor, so a reported weight is checked exactly: an
inflated one would take over the mean (1e12 against 1e5 replaces the model), an absurd one (1e300) overflow the sums.
Pure Python: the ServerApp and the groups' sync both use it.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Iterable

from flwr_sharded.parallel.verdict import WEIGHT, Verdict

WEIGHT_RTOL = 1e-9
"""Relative difference between a reported and an expected weight still taken as equal: weights are integer token
counts summed in float64, exact far beyond any run's size; the margin only absorbs a float round trip."""


def tokens(*, steps: int, batch_size: int, grad_accum: int, seq_len: int, ranks: int) -> int:
    """The tokens `ranks` ranks train on in `steps` optimizer steps (the data stream always yields full batches)."""
    return steps * batch_size * grad_accum * seq_len * ranks


def tokens_of(train: Any, *, steps: int, ranks: int = 1) -> int:
    """`tokens` with the batch, gradient accumulation and sequence length of a `TrainConfig`."""
    return tokens(steps=steps, batch_size=train.batch_size, grad_accum=train.grad_accum, seq_len=train.data.seq_len,
                  ranks=ranks)


def expected_weight(*, steps: int, batch_size: int, grad_accum: int, seq_len: int, worlds: Iterable[int]) -> float:
    """The tokens groups of `worlds` ranks (one entry per group: one for a sync, one per member for a facility)
    trained on in `steps` optimizer steps."""
    ranks = 0
    for world in worlds:
        if int(world) < 1:
            raise ValueError(f"a group has at least one rank, got {world!r}")
        ranks += int(world)
    if steps < 0 or min(batch_size, grad_accum, seq_len) < 1 or ranks < 1:
        raise ValueError(f"no tokens: steps {steps}, batch {batch_size}, grad-accum {grad_accum}, seq {seq_len}, "
                         f"{ranks} ranks")
    return float(tokens(steps=steps, batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len, ranks=ranks))


def expected_weight_of(train: Any, *, steps: int, worlds: Iterable[int]) -> float:
    """`expected_weight` with the batches of a `TrainConfig`."""
    return expected_weight(steps=steps, batch_size=train.batch_size, grad_accum=train.grad_accum,
                           seq_len=train.data.seq_len, worlds=worlds)


def weight_verdict(member: Hashable, weight: Any, expected: float | None = None, rtol: float = WEIGHT_RTOL, *,
                   at_most: float | None = None) -> Verdict | None:
    """None if `weight` is a finite number > 0, (given `expected`) equals it within `rtol` and (given `at_most`) is
    not above that bound; else a `Verdict` on `member` saying why not."""
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if not (number and math.isfinite(weight) and weight > 0):
        return Verdict(member, f"weight must be a finite number > 0, got {weight!r}", WEIGHT)
    if at_most is not None and weight > at_most:
        return Verdict(member, f"weight {float(weight):.6g} is out of bounds: the round's steps, batch, sequence "
                               f"length and ranks give at most {at_most:.6g} tokens", WEIGHT)
    if expected is None:
        return None
    if not (math.isfinite(expected) and expected > 0):
        raise ValueError(f"an expected weight is a finite number > 0, got {expected!r}")
    if abs(float(weight) - expected) > rtol * expected:
        return Verdict(member, f"weight {float(weight):.6g} is out of bounds: the round's steps, batch, sequence "
                               f"length and ranks give {expected:.6g} tokens", WEIGHT)
    return None


def check_weight(weight: Any, expected: float | None = None, rtol: float = WEIGHT_RTOL, *,
                 at_most: float | None = None) -> str | None:
    """`weight_verdict`'s reason alone (None: the weight is right), for a caller that names the contributor."""
    verdict = weight_verdict(None, weight, expected, rtol, at_most=at_most)
    return verdict.reason if verdict is not None else None


__all__ = ["WEIGHT_RTOL", "check_weight", "expected_weight", "expected_weight_of", "tokens", "tokens_of",
           "weight_verdict"]
