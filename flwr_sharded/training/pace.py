"""Each group's local steps per sync period in the static engine (`group-steps`), and the periods all groups count alike.

With `equal`, every group trains A steps per period, as the schedule says. With `speed`, the groups measure their step
times over each period and exchange them after its sync (with the sync's wall time on each, whose excess over the
shortest is the time that group idled waiting for the others); the next period the fastest group trains A steps and
group g about A t_fastest / t_g (`local_steps`), so that the groups arrive at the sync together. The sync's weights
stay the tokens each group trained.

Groups then take different numbers of steps, so what the world does together (logging's and evaluation's
all-reduces, the end of the run) happens on the reference clock, the fastest group's step count: periods x A, where
the groups agree. Each group's learning-rate schedule follows the same clock (a group that takes half the steps
moves its schedule two steps per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

GROUP_STEPS = ("equal", "speed")
"""`group-steps`: every group A local steps per sync, or each group its own from its speed."""


def local_steps(A: int, step_times: Sequence[float]) -> tuple[int, ...]:
    """Local steps per sync of each group so that all arrive together: the fastest group's A, and
    A_g = max(1, round(A t_fastest / t_g)) for the others."""
    if not step_times or min(step_times) <= 0:
        raise ValueError(f"step times must be positive, got {list(step_times)}")
    fastest = min(step_times)
    return tuple(max(1, round(A * fastest / t)) for t in step_times)


def idle_times(steps: Sequence[int], step_times: Sequence[float]) -> tuple[float, ...]:
    """Seconds each group waits per sync for the last one to finish its steps: max_h (A_h t_h) - A_g t_g."""
    arrivals = [a * t for a, t in zip(steps, step_times)]
    return tuple(max(arrivals) - x for x in arrivals)


@dataclass
class Pace:
    """One group's position in the run's sync periods.

    Args:
        A: `aggregate-every`, the fastest group's steps per period.
        adapt: `group-steps speed`: each period's steps from the groups' step times.
        member: this group's index among the groups.
    """

    A: int
    adapt: bool
    member: int
    steps: int = 0
    """This group's local steps in the current period (A until the first exchange)."""
    periods: int = 0
    """Periods completed (adopted syncs of the last fragment)."""
    period_start: int = 0
    """The group's step count when the current period began."""
    compute_s: float = 0.0
    """Seconds this rank spent in inner steps in the current period."""
    last: dict[str, list[float]] = field(default_factory=dict)
    """The last exchange: every group's step time, sync seconds, idle seconds and steps."""

    def __post_init__(self) -> None:
        self.steps = self.steps or self.A

    def step_in_period(self, step_count: int) -> int:
        """1..steps: where `step_count` falls in the current period."""
        if not self.adapt:
            return (step_count - 1) % self.A + 1
        return step_count - self.period_start

    def reference(self, step_count: int) -> float:
        """The run's clock at this group's `step_count`: its own step count, or with `adapt` the fastest group's."""
        if not self.adapt:
            return float(step_count)
        return self.periods * self.A + (step_count - self.period_start) * self.A / self.steps

    def tick(self, step_count: int) -> int | None:
        """The reference step at which the world may act together after `step_count` (log, evaluate, stop): every
        step without `adapt`; with it, only at the end of a period."""
        if not self.adapt:
            return step_count
        return self.periods * self.A if step_count == self.period_start else None

    def finished(self, step_count: int, total: int) -> bool:
        return self.reference(step_count) >= total

    def end_period(self, step_count: int) -> None:
        """A period's sync was adopted: the next one starts here."""
        self.periods += 1
        self.period_start = step_count
        self.compute_s = 0.0

    def restart_period(self, step_count: int) -> None:
        """A sync failed and every rank is back at the last adopted one: the period starts again there."""
        self.period_start = step_count
        self.compute_s = 0.0

    def exchange(self, sync_s: float, steps: int, leaders: dist.ProcessGroup | None, group: dist.ProcessGroup,
                 leader: bool, members: int, device: torch.device) -> dict[str, list[float]]:
        """After a sync: every group's (step time, sync seconds, steps) over the leaders, then to every rank of the
        group (two small collectives); with `adapt`, the next period's steps. Returns what `last` keeps."""
        box = torch.zeros(members * 3, dtype=torch.float64, device=device)
        mine = torch.tensor([self.compute_s / max(1, steps), sync_s, float(steps)], dtype=torch.float64,
                            device=device)
        if leader and leaders is not None:
            dist.all_gather_single(box, mine, group=leaders)
        elif leader:
            box.copy_(mine)
        dist.broadcast(box, group=group, group_src=0)
        step_s, sync, counts = (box.view(members, 3).T.tolist())
        shortest = min(sync)
        self.last = {"step_time_s": step_s, "sync_s": sync, "idle_s": [s - shortest for s in sync],
                     "steps": [int(c) for c in counts]}
        if self.adapt and all(t > 0 and math.isfinite(t) for t in step_s):
            self.steps = local_steps(self.A, step_s)[self.member]
        return self.last


__all__ = ["GROUP_STEPS", "Pace", "idle_times", "local_steps"]
