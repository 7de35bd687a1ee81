"""When each fragment of the model syncs within a period of A local steps (Streaming DiLoCo's staggered syncs).

Fragment i of N is merged after step b_i = round((i + 1) A / N) of the period (steps counted 1..A; the last
fragment at A) and, with a delay tau > 0, its sync starts after step b_i - tau, so its communication overlaps the
tau steps in between. A delay must be smaller than the fewest steps between two boundaries, so at most one sync is
in flight at a time and none spans two periods (a period's end is a clean point: checkpoints, rounds).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """When each fragment starts and merges within a period of A steps (steps counted 1..A)."""

    aggregate_every: int
    """A: local steps per period (`aggregate-every`)."""
    fragments: int = 1
    """N: fragments synced at staggered points of the period."""
    delay: int = 0
    """tau: steps between a fragment's start and its merge (0: a blocking sync at the boundary)."""

    def __post_init__(self) -> None:
        if not 1 <= self.fragments <= self.aggregate_every:
            raise ValueError(f"{self.fragments} fragments in a period of {self.aggregate_every} steps: between 1 and "
                             f"{self.aggregate_every} (one boundary per step at most)")
        if not 0 <= self.delay < self.shortest_share():
            raise ValueError(f"a delay of {self.delay} steps: it must be in [0, {self.shortest_share()}), the fewest "
                             f"steps between two fragments' syncs")

    def boundary(self, i: int) -> int:
        """The step after which fragment i's sync is merged: round((i + 1) A / N); the last one is A."""
        return round((i + 1) * self.aggregate_every / self.fragments)

    def starts(self, step: int) -> list[int]:
        """Fragments whose overlapped sync starts after `step` of the period (none when the delay is 0)."""
        return [i for i in range(self.fragments) if self.delay and self.boundary(i) - self.delay == step]

    def merges(self, step: int) -> list[int]:
        """Fragments whose sync completes after `step` of the period (a blocking one when the delay is 0)."""
        return [i for i in range(self.fragments) if self.boundary(i) == step]

    def shortest_share(self) -> int:
        """The fewest steps between two consecutive boundaries (a delay must be smaller)."""
        return min(self.boundary(i) - (self.boundary(i - 1) if i else 0) for i in range(self.fragments))

    @staticmethod
    def shortest_share_of(aggregate_every: int, fragments: int) -> int:
        """`shortest_share` of N fragments in a period of A steps (for checks before a Schedule can be built)."""
        return Schedule(aggregate_every, max(1, min(fragments, aggregate_every))).shortest_share()
