"""An overlapped sync's thread, in process: an abandoned flight still running holds back the next start (it writes
into the shared snapshot), a failed reduction reaches `finish`. The reduction is replaced by one that waits."""

from __future__ import annotations

import threading

import pytest
import torch

from flwr_sharded.parallel.sync import ShardSync


def _sync(reduce) -> ShardSync:
    """A sync over a placeholder group (no collective runs: `_reduce` is replaced, alignment taken as checked)."""
    sync = ShardSync([("w", torch.arange(8.0))], fed_group=object())
    sync._aligned = True
    sync._reduce = reduce
    return sync


def test_a_start_waits_for_an_abandoned_flight_and_refuses_while_it_runs_on():
    release, started = threading.Event(), []

    def slow(flight) -> None:
        started.append(flight)
        release.wait(30)
        flight.sends[0].fill_(7.0)  # what a late reduction writes: into the snapshot every fragment shares

    sync = _sync(slow)
    sync.start(1.0, overlap=True)
    sync.abandon(timeout=0.05)
    assert not sync.in_flight and started
    sync.overlap.abandoned_wait = 0.1
    with pytest.raises(RuntimeError, match="abandoned sync of this fragment is still running"):
        sync.start(1.0, overlap=True)
    assert not sync.in_flight  # nothing was copied into the snapshot meanwhile

    sync.overlap.abandoned_wait = 30.0
    threading.Timer(0.2, release.set).start()
    sync._reduce = lambda flight: None
    sync.start(1.0, overlap=True)  # waits for the old thread, then copies the shards afresh
    assert not started[0].thread.is_alive()
    sync.finish()
    assert torch.equal(sync.params[0], torch.arange(8.0))  # the late write came before the copy, not after


def test_a_flight_abandoned_after_its_thread_ended_does_not_hold_back_the_next():
    """A flight whose thread had ended is forgotten by `abandon`: the next sync starts at once, even with no time
    to wait (`abandoned_wait` 0), reduces and merges."""
    reduced = []
    sync = _sync(lambda flight: reduced.append(flight))
    sync.start(1.0, overlap=True)
    first = sync._flight.thread
    first.join(5.0)
    assert not first.is_alive() and len(reduced) == 1
    sync.abandon(timeout=5.0)
    assert not sync.in_flight and sync.overlap.abandoned is None  # nothing left to wait for
    sync.overlap.abandoned_wait = 0.0
    with torch.no_grad():
        sync.params[0].add_(1.0)  # the next sync copies the shards as they are now
    sync.start(1.0, overlap=True)
    assert sync.in_flight
    sync.finish(timeout=5.0)
    assert len(reduced) == 2 and reduced[1] is not reduced[0] and not sync.in_flight
    assert torch.equal(sync.params[0], torch.arange(8.0) + 1.0)  # one member's mean is its own shard


def test_the_reductions_error_reaches_finish_and_the_next_sync_starts():
    def failing(flight) -> None:
        raise ConnectionError("peer gone")

    sync = _sync(failing)
    sync.start(1.0, overlap=True)
    with pytest.raises(ConnectionError, match="peer gone"):
        sync.finish(timeout=10)
    sync._reduce = lambda flight: None
    sync.start(1.0, overlap=True)
    sync.finish(timeout=10)
