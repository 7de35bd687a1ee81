"""When each fragment of the model syncs within a period (Streaming DiLoCo's staggered syncs), and how many local
steps each group takes per period when groups run at different speeds (`group-steps speed`). Torch-free.

Fragment i of N is merged after step b_i = round((i + 1) A / N) of the period (steps counted 1..A; the last
fragment at A) and, with a delay tau > 0, its sync starts after step b_i - tau, so its communication overlaps the
tau steps in between. A delay must be smaller than the fewest steps between two boundaries, so at most one sync is
in flight at a time and none spans two periods (a period's end is a clean point: checkpoints, rounds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Schedule:
    """When each fragment starts and merges within a period of `steps` local steps (counted 1..steps)."""

    steps: int
    """This group's local steps per period: A, or a slower group's fewer (`group-steps speed`, `local_steps`)."""
    fragments: int = 1
    """N: fragments synced at staggered points of the period."""
    delay: int = 0
    """tau: steps between a fragment's start and its merge (0: a blocking sync at the boundary)."""

    def __post_init__(self) -> None:
        if not 1 <= self.fragments <= self.steps:
            raise ValueError(f"{self.fragments} fragments in a period of {self.steps} steps: between 1 and "
                             f"{self.steps} (one boundary per step at most)")
        if not 0 <= self.delay < self.shortest_share():
            raise ValueError(f"a delay of {self.delay} steps: it must be in [0, {self.shortest_share()}), the fewest "
                             f"steps between two fragments' syncs")

    def boundary(self, i: int) -> int:
        """The step after which fragment i's sync is merged: round((i + 1) steps / N); the last one is `steps`."""
        return round((i + 1) * self.steps / self.fragments)

    def starts(self, step: int) -> list[int]:
        """Fragments whose overlapped sync starts after `step` of the period (none when the delay is 0)."""
        return [i for i in range(self.fragments) if self.delay and self.boundary(i) - self.delay == step]

    def merges(self, step: int) -> list[int]:
        """Fragments whose sync completes after `step` of the period (a blocking one when the delay is 0)."""
        return [i for i in range(self.fragments) if self.boundary(i) == step]

    def due(self, step: int) -> bool:
        """Whether a sync merges or starts after `step` of the period."""
        return bool(self.merges(step) or self.starts(step))

    def shortest_share(self) -> int:
        """The fewest steps between two consecutive boundaries (a delay must be smaller)."""
        return min(self.boundary(i) - (self.boundary(i - 1) if i else 0) for i in range(self.fragments))

    @staticmethod
    def shortest_share_of(steps: int, fragments: int) -> int:
        """`shortest_share` of N fragments in a period of `steps` steps (for checks before a Schedule is built)."""
        return Schedule(steps, max(1, min(fragments, steps))).shortest_share()


def fragment_parameters(model: Any, blocks: Sequence[Any], fragments: int) -> list[list[tuple[str, Any]]]:
    """Cut `model`'s named parameters into `fragments` groups of contiguous blocks, in parameter order: what comes
    before the first block (embeddings) goes with the first group, what follows the last block (final norm, output
    head) with the last one. ValueError if there are more fragments than blocks."""
    if not 1 <= fragments <= len(blocks):
        raise ValueError(f"{fragments} fragments of a model with {len(blocks)} blocks: at most one per block")
    block_of = {id(p): b for b, block in enumerate(blocks) for p in block.parameters()}
    out: list[list[tuple[str, Any]]] = [[] for _ in range(fragments)]
    seen_block = False
    for name, param in model.named_parameters():
        b = block_of.get(id(param))
        if b is not None:
            seen_block = True
            out[b * fragments // len(blocks)].append((name, param))
        else:
            out[-1 if seen_block else 0].append((name, param))
    return out


def local_steps(A: int, step_times: Sequence[float]) -> tuple[int, ...]:
    """Local steps per period of each group so that all arrive at the sync together: the fastest group's A, and
    A_g = max(1, round(A t_fastest / t_g)) for the others."""
    if not step_times or min(step_times) <= 0:
        raise ValueError(f"step times must be positive, got {list(step_times)}")
    fastest = min(step_times)
    return tuple(max(1, round(A * fastest / t)) for t in step_times)


def idle_times(steps: Sequence[int], step_times: Sequence[float]) -> tuple[float, ...]:
    """Seconds each group waits per sync for the last one to finish its steps: max_h (A_h t_h) - A_g t_g."""
    arrivals = [a * t for a, t in zip(steps, step_times)]
    return tuple(max(arrivals) - x for x in arrivals)


__all__ = ["Schedule", "fragment_parameters", "idle_times", "local_steps"]
