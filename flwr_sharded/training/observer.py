"""What sees a rank's `SyncLoop` at work without changing its code: a `SyncObserver` in `loop.observers` (the traffic
probe, a bench's slowed group, a test's injected faults). The loop calls its observers in the order they were added,
at these points of its periods:

    on_period_start
      on_step_begin, on_step_end                         (each inner step)
      on_merge, [on_reduced], on_outcome                 (each fragment's merge: blocking sync or overlapped one's)
      on_sync_start, on_sync_started                     (each overlapped sync started)
    on_period_end                                        (its syncs adopted)

An observer only watches, except where a method says what it may do. Torch-free, like the planner's imports of
`flwr_sharded.parallel.traffic`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from flwr_sharded.parallel.traffic import TrafficProbe
    from flwr_sharded.training.federation import SyncOutcome
    from flwr_sharded.training.sync_loop import SyncLoop


class SyncObserver:
    """Sees one rank's `SyncLoop`; every method here does nothing (override the ones wanted)."""

    def on_period_start(self, loop: SyncLoop) -> None:
        """A period begins, or goes on after a rollback (`loop.period_start` and its clock are set)."""

    def on_step_begin(self, loop: SyncLoop) -> None:
        """An inner step begins (its time, `loop.compute_s`, is running)."""

    def on_step_end(self, loop: SyncLoop, loss: Any) -> None:
        """An inner step ended, within its time: what this method takes (a sleep) makes the step as much slower."""

    def on_sync_start(self, loop: SyncLoop, i: int) -> None:
        """Fragment i's overlapped sync is about to start (every rank; replica 0 takes its copy of the shards and
        its verdict on them now). It may change the shards this sync sends."""

    def on_sync_started(self, loop: SyncLoop, i: int) -> None:
        """Fragment i's overlapped sync started (or failed to: its merge tells every rank)."""

    def on_merge(self, loop: SyncLoop, i: int) -> None:
        """Fragment i's merge begins (every rank): an overlapped sync's, or a blocking sync as a whole (start,
        reduction, commit). It may change the shards a blocking sync sends."""

    def on_reduced(self, loop: SyncLoop, i: int) -> None:
        """Replica 0: fragment i's reduction arrived on this rank, before it is merged (an overlapped sync) or voted
        on (a blocking one). It may raise: the loop takes the exception as this rank's error there, as it takes the
        reduction's own (`CollectiveTimeout`: a failed collective); a blocking sync's rank then votes no."""

    def on_outcome(self, loop: SyncLoop, outcome: SyncOutcome) -> None:
        """Fragment `outcome.fragment`'s merge ended as every rank knows it (adopted, failed or deferred)."""

    def on_period_end(self, loop: SyncLoop) -> None:
        """A period ended with its syncs adopted (after `SyncLoop.run`'s `on_period`)."""


class TrafficWindows(SyncObserver):
    """`train --measure-traffic`: the probe's windows over the loop, one per inner step ("step") and one per fragment
    merge on every rank ("sync": the reduction, the commit, the replicas' broadcast); starting an overlapped sync
    counts under "sync" too, not as a window."""

    def __init__(self, probe: TrafficProbe) -> None:
        self.probe = probe

    def on_step_begin(self, loop: SyncLoop) -> None:
        self.probe.begin("step")

    def on_step_end(self, loop: SyncLoop, loss: Any) -> None:
        self.probe.end()

    def on_merge(self, loop: SyncLoop, i: int) -> None:
        self.probe.begin("sync")

    def on_outcome(self, loop: SyncLoop, outcome: SyncOutcome) -> None:
        self.probe.end()

    def on_sync_start(self, loop: SyncLoop, i: int) -> None:
        self.probe.begin("sync", count=False)

    def on_sync_started(self, loop: SyncLoop, i: int) -> None:
        self.probe.end()


ObserverFactory = Callable[["SyncLoop"], "SyncObserver | None"]
"""Called with each new loop; returns the observer to add to it (None: none)."""

_every_loop: list[ObserverFactory] = []


def observe_every_loop(factory: ObserverFactory) -> None:
    """Give every `SyncLoop` this process builds from now on the observer `factory(loop)` (a process whose loops are
    built by the package's entry points: a test's faults, a bench's slowed group)."""
    _every_loop.append(factory)


def observers_for(loop: SyncLoop) -> list[SyncObserver]:
    """The observers `observe_every_loop` gives a new loop."""
    return [o for o in (factory(loop) for factory in _every_loop) if o is not None]


__all__ = ["ObserverFactory", "SyncObserver", "TrafficWindows", "observe_every_loop", "observers_for"]
