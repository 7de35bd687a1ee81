"""The sync loop's periods: each group's local steps per sync (`group-steps`), the run's clock, the refusals, and the
depth of its calls down to a bucket's collective."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flwr_sharded.config import TrainConfig
from flwr_sharded.validation import validate, validate_static
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.schedule import idle_times, local_steps


def test_local_steps_let_groups_of_different_speeds_arrive_together():
    assert local_steps(8, [0.1, 0.2, 0.4]) == (8, 4, 2)
    assert local_steps(8, [0.3, 0.1]) == (3, 8)  # the fastest need not be group 0
    assert local_steps(4, [0.1, 10.0]) == (4, 1)  # at least one step
    assert idle_times((8, 4), (0.1, 0.2)) == pytest.approx((0.0, 0.0))
    assert idle_times((8, 8), (0.1, 0.2)) == pytest.approx((0.8, 0.0))  # today's: the fast group waits 8 x 0.1 s
    with pytest.raises(ValueError):
        local_steps(8, [0.1, 0.0])


class _Trainer:
    """What `SyncLoop.run` drives, without a model: a step counter and the learning-rate schedule."""

    def __init__(self, cfg: TrainConfig) -> None:
        import torch

        from flwr_sharded.training.metrics import PhaseTimer
        from flwr_sharded.training.trainer import Trainer, lr_lambda

        self.cfg, self.device, self.timer, self.step_count = cfg, torch.device("cpu"), PhaseTimer("cpu"), 0
        self.topo = SimpleNamespace(group_worlds=[1], replica_index=0, group_world=1)
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.move_schedule = Trainer.move_schedule.__get__(self)

    @property
    def schedule_step(self) -> int:
        return int(self.scheduler.last_epoch)

    def step(self):
        import torch

        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        return torch.zeros(())


def _ticks(group_steps: str, steps: int) -> list[tuple[int, int | None, int]]:
    """(step count, tick, the schedule's step) after every step of a run of 8 clock steps, A = 4, when this group
    takes `steps` steps per period."""
    import dataclasses

    from flwr_sharded.training.sync_loop import SyncLoop

    cfg = TrainConfig(steps=8)
    cfg.parallel.method, cfg.parallel.aggregate_every, cfg.parallel.group_steps = "fsdp", 4, group_steps
    t = _Trainer(cfg)
    loop = SyncLoop(t)
    loop.schedule = dataclasses.replace(loop.schedule, steps=steps)  # what an exchange of step times sets
    out = []
    loop.run(None, until=cfg.steps, on_step=lambda loss, tick: out.append((t.step_count, tick, t.schedule_step)))
    return out


def test_the_runs_clock_is_the_fastest_groups_step_count():
    """A group half as fast takes two steps per period: its schedule moves two steps per step, the world acts together
    (logs, evaluates) at the periods' ends only, on the clock's step, and the run ends when the clock reaches its
    steps; with equal steps every step is a tick."""
    assert _ticks("speed", 2) == [(1, None, 2), (2, 4, 4), (3, None, 6), (4, 8, 8)]
    assert _ticks("equal", 4) == [(s, s, s) for s in range(1, 9)]


@pytest.mark.parametrize("options,message", [
    (dict(sync_delay=1), "use one fragment and no delay"),
    (dict(outer="median"), "ignores the weights"),
    (dict(method="fsdp", federations=1), "needs an FL method"),
])
def test_group_steps_refuses_what_needs_equal_steps(options, message):
    cfg = TrainConfig(steps=16)
    cfg.parallel.method, cfg.parallel.federations, cfg.parallel.aggregate_every = "fl-fsdp", 2, 4
    cfg.parallel.group_steps = "speed"
    for key, value in options.items():
        setattr(cfg.parallel, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_group_steps_needs_whole_periods_and_no_periodic_checkpoints():
    cfg = TrainConfig(steps=10)
    cfg.parallel.method, cfg.parallel.federations, cfg.parallel.aggregate_every = "fl-fsdp", 2, 4
    cfg.parallel.group_steps = "speed"
    validate(cfg)  # a Flower run trains whole rounds: only the static engine counts steps
    with pytest.raises(ConfigError, match="must be a multiple of --aggregate-every"):
        validate_static(cfg)
    cfg.steps = 16
    validate_static(cfg)
    cfg.checkpoint.dir, cfg.checkpoint.resume = "ckpt", True
    with pytest.raises(ConfigError, match="without --checkpoint-every or --resume"):
        validate_static(cfg)


@pytest.mark.parametrize("group_steps", ["speed", "equal"])
def test_a_step_time_that_sets_the_steps_waits_for_the_devices_kernels(monkeypatch, group_steps):
    """With `group-steps speed` on CUDA each step's time includes its queued kernels (the main stream synchronised
    where the time is read); `equal` adds no synchronisation. A stand-in stream takes 20 ms to drain."""
    import time

    import torch

    from flwr_sharded.training.sync_loop import SyncLoop

    drained = []

    class Stream:
        def synchronize(self) -> None:
            time.sleep(0.02)
            drained.append(1)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    cfg = TrainConfig(steps=4)
    cfg.parallel.method, cfg.parallel.aggregate_every, cfg.parallel.group_steps = "fsdp", 4, group_steps
    t = _Trainer(cfg)
    t.device = torch.device("cuda")
    loop = SyncLoop(t)
    periods = []
    loop.run(None, until=cfg.steps, on_step=lambda loss, tick: periods.append(loop.compute_s))
    if group_steps == "speed":
        assert len(drained) == 4 and periods[-1] >= 4 * 0.02
    else:
        assert not drained and periods[-1] < 4 * 0.02


class _Sync:
    """A fragment's sync without collectives or parameters: a member alone, whose result is its own."""

    def __init__(self) -> None:
        self.params, self.left_out, self.confirmed, self.max_weight, self.in_flight = [], [], True, None, False

    def start(self, weight: float, *, overlap: bool, dense: bool = False, adopted: int = 0) -> None:
        self.in_flight = True

    def receive(self, **kwargs) -> None:
        pass

    def merge(self):
        from flwr_sharded.parallel.flight import SyncStats

        self.in_flight = False
        return SyncStats(seconds=0.0, buckets=1, bytes=0, total_weight=1.0)

    def abandon(self, timeout: float = 5.0) -> None:
        self.in_flight = False


def _observed(delay: int, fail_at: int | None = None) -> tuple[list[str], str]:
    """A member alone syncing one fragment every 2 steps over 4 (`delay`: an overlapped sync's), seen by an observer
    that fails the `fail_at`-th reduction; its events and the run's error."""
    from flwr_sharded.parallel.schedule import Schedule
    from flwr_sharded.training.observer import SyncObserver
    from flwr_sharded.training.sync_loop import SyncLoop

    class Recorder(SyncObserver):
        def __init__(self) -> None:
            self.events: list[str] = []
            self.reduced = 0

        def on_period_start(self, loop):
            self.events.append("period")

        def on_step_begin(self, loop):
            self.events.append(f"step {loop.trainer.step_count + 1}")

        def on_step_end(self, loop, loss):
            self.events.append("stepped")

        def on_sync_start(self, loop, i):
            self.events.append(f"start {i}")

        def on_sync_started(self, loop, i):
            self.events.append(f"started {i}")

        def on_merge(self, loop, i):
            self.events.append(f"merge {i}")

        def on_reduced(self, loop, i):
            self.events.append(f"reduced {i}")
            self.reduced += 1
            if self.reduced == fail_at:
                raise RuntimeError("injected")

        def on_outcome(self, loop, outcome):
            self.events.append("adopted" if outcome.adopted else f"failed: {outcome.error}")

        def on_period_end(self, loop):
            self.events.append("end")

    cfg = TrainConfig(steps=4)
    cfg.parallel.method, cfg.parallel.aggregate_every = "fsdp", 2
    t = _Trainer(cfg)
    t.topo = SimpleNamespace(group_worlds=[1], replica_index=0, group_world=1, shard_index=0, rep_group=None)
    t.set_anchor = lambda params=None: None
    loop = SyncLoop(t)
    loop.syncs, loop.tokens, loop.schedule = [_Sync()], [0], Schedule(2, 1, delay)
    recorder = Recorder()
    loop.observers.append(recorder)
    federation = SimpleNamespace(member_index=0, members=1, wait_timeout=None, join=lambda: None,
                                 vote_group=lambda: None, gather=lambda obj: [obj], flags=lambda values: values,
                                 behind=lambda adopted: [], period_times=lambda *args, now: None,
                                 last_times=lambda: None)
    report = loop.run(federation, until=cfg.steps)
    return recorder.events, report.error


def test_an_observer_sees_the_loops_periods_steps_and_syncs_in_order():
    one_period = ["period", "step 1", "stepped", "step 2", "stepped", "merge 0", "reduced 0", "adopted", "end"]
    assert _observed(0) == ([*one_period, *[e.replace("1", "3").replace("2", "4") for e in one_period], "period"], "")
    overlapped = ["period", "step 1", "stepped", "start 0", "started 0", "step 2", "stepped", "merge 0", "reduced 0",
                  "adopted", "end"]
    assert _observed(1)[0][:len(overlapped)] == overlapped


def test_each_period_ends_by_returning_the_heaps_free_pages(monkeypatch):
    from flwr_sharded import host_memory

    trims = []
    monkeypatch.setattr(host_memory, "after_period", lambda: trims.append("trim"))
    events, error = _observed(0)
    assert error == "" and events.count("end") == 2 and trims == ["trim", "trim"]


def test_an_observer_that_raises_at_the_reduction_fails_that_sync():
    """As the reduction's own error: this rank's part failed, the sync is not adopted, the run ends with it."""
    events, error = _observed(0, fail_at=2)
    assert events[-3:] == ["merge 0", "reduced 0", "failed: shard 0: RuntimeError: injected"]
    assert "end" not in events[9:] and error == "shard 0: RuntimeError: injected"
