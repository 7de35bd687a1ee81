"""Bounded damage at the server: which contributions to a chunk are out of bounds, and the robust rules.

Out of bounds (`out_of_bounds`), decided once every contribution to a chunk is in, so the order of arrival does not
matter:

- **magnitude**: a contribution whose largest |value| in the chunk exceeds `ratio` x max(1, the median of all the
  contributions' largest |values|) (the lower median: with two, the smaller one) is excluded. Honest facilities
  start the round from the same global model and move a little from it, so their largest values in a chunk agree
  to a small factor; a facility that sends 1e30 (finite, so the NaN/Inf check lets it through) would otherwise set
  the mean. With `ratio` 0 this test is off.
- **overflow**: the mean's sums are fp32; they cannot overflow while sum(weight x largest |value|) over the
  contributions stays within `SUM_LIMIT` (half the fp32 range). Beyond it, the contribution with the largest
  weight x |value| is excluded, then the next, until the rest fit. This is always on.

Robust rules (`combine`): the coordinate-wise median or trimmed mean of the contributions (unweighted, as Flower's
FedMedian and FedTrimmedAvg; `flwr_sharded.parallel.outer.trimmed_mean` and `median_trim`, the math of the
decentralised path's `trimmed-mean` and `median` rules, so an even number of facilities averages the two middle
values on both paths). They need every contribution's rows of a chunk at once: `ChunkStack` holds them, F x the chunk,
in the wire dtype.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from flwr_sharded.parallel.outer import median_trim, trimmed_mean
from flwr_sharded.parallel.verdict import MAGNITUDE, OVERFLOW, Verdict, reasons

SUM_LIMIT = torch.finfo(torch.float32).max / 2
"""Bound on sum(weight x largest |value|) over a chunk's contributions: the fp32 sums stay below it, with a margin
for rounding, so they stay finite."""
ROBUST_RULES = ("median", "trimmed-mean")
"""The server rules that are not the weighted mean."""


def min_contributors(rule: str, trim: int) -> int:
    """The fewest contributions `rule` can combine."""
    return 2 * trim + 1 if rule == "trimmed-mean" else 1


def trim_of(rule: str, trim: int, n: int) -> int:
    """Values dropped from each side of each coordinate when `rule` combines `n` contributions (the median's:
    `flwr_sharded.parallel.outer.median_trim`, as the decentralised path's `median` rule)."""
    return median_trim(n) if rule == "median" else trim


def out_of_bounds_verdicts(stats: Mapping[str, tuple[float, float]], ratio: float, *,
                           sums: bool = True) -> list[Verdict]:
    """The contributions excluded from a chunk and why (`Verdict.member`: the source), from each one's (weight,
    largest |value|) in it (module doc); `sums=False` (a robust rule, which sums no weighted values) skips the
    overflow test."""
    out: list[Verdict] = []
    if ratio > 0 and len(stats) > 1:
        largest = sorted(m for _, m in stats.values())
        median = largest[(len(largest) - 1) // 2]
        bound = ratio * max(1.0, median)
        for source, (_, m) in stats.items():
            if m > bound:
                out.append(Verdict(source, f"its largest |value| {m:.3g} is more than {ratio:g} x max(1, "
                                           f"{median:.3g}), the median of the facilities' largest |values| in this "
                                           f"chunk", MAGNITUDE))
    excluded = {v.member for v in out}
    kept = {s: w * m for s, (w, m) in stats.items() if s not in excluded} if sums else {}
    total = math.fsum(kept.values())
    for source in sorted(kept, key=kept.__getitem__, reverse=True):
        if total <= SUM_LIMIT:
            break
        out.append(Verdict(source, f"the mean would overflow: its weight x largest |value| is {kept[source]:.3g}, "
                                   f"all of them together {total:.3g}, above the {SUM_LIMIT:.3g} fp32 sums can hold",
                           OVERFLOW))
        total -= kept[source]
    return out


def out_of_bounds(stats: Mapping[str, tuple[float, float]], ratio: float, *, sums: bool = True) -> dict[str, str]:
    """source -> why it is excluded (`out_of_bounds_verdicts`' reasons)."""
    return reasons(out_of_bounds_verdicts(stats, ratio, sums=sums))


class ChunkStack:
    """Every contribution's rows of one window, stacked per parameter (slot i = the i-th accepted contribution), in
    the pieces' dtype: memory = slots x the window, whatever the model size."""

    def __init__(self, window: Mapping[str, tuple[int, int]], shapes: Mapping[str, tuple[int, ...]],
                 dtypes: Mapping[str, torch.dtype], slots: int) -> None:
        if slots < 1:
            raise ValueError("a stack needs at least one slot")
        self.window = dict(window)
        self.slots = slots
        self.filled = 0
        self._stack = {name: torch.empty((slots, stop - start, *shapes[name][1:]) if shapes[name] else (slots,),
                                         dtype=dtypes[name]) for name, (start, stop) in self.window.items()}

    def put(self, slot: int, name: str, row_offset: int, data: torch.Tensor) -> None:
        """Copy a piece's rows (global offset `row_offset`) into `slot`."""
        start = self.window[name][0]
        target = self._stack[name][slot]
        if target.dim():  # a scalar parameter's slot is the whole value
            target = target[row_offset - start:row_offset - start + data.shape[0]]
        target.copy_(data.reshape(target.shape))

    def combine(self, rule: str, trim: int, n: int) -> dict[str, torch.Tensor]:
        """name -> the rule over the first `n` slots, fp32, for the window's rows."""
        if not 1 <= n <= self.slots:
            raise ValueError(f"{n} contributions for {self.slots} slots")
        cut = trim_of(rule, trim, n)
        return {name: trimmed_mean(stack[:n], cut) for name, stack in self._stack.items()}


__all__ = ["ROBUST_RULES", "SUM_LIMIT", "ChunkStack", "min_contributors", "out_of_bounds", "out_of_bounds_verdicts",
           "trim_of"]
