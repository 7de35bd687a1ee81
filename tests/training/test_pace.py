"""Each group's local steps per sync (`group-steps`): the formula, the reference clock, and the refusals."""

from __future__ import annotations

import pytest

from flwr_sharded.config import TrainConfig
from flwr_sharded.validation import validate, validate_static
from flwr_sharded.errors import ConfigError
from flwr_sharded.training.pace import Pace, idle_times, local_steps


def test_local_steps_let_groups_of_different_speeds_arrive_together():
    assert local_steps(8, [0.1, 0.2, 0.4]) == (8, 4, 2)
    assert local_steps(8, [0.3, 0.1]) == (3, 8)  # the fastest need not be group 0
    assert local_steps(4, [0.1, 10.0]) == (4, 1)  # at least one step
    assert idle_times((8, 4), (0.1, 0.2)) == pytest.approx((0.0, 0.0))
    assert idle_times((8, 8), (0.1, 0.2)) == pytest.approx((0.8, 0.0))  # today's: the fast group waits 8 x 0.1 s
    with pytest.raises(ValueError):
        local_steps(8, [0.1, 0.0])


def test_the_reference_clock_is_the_fastest_groups_step_count():
    equal = Pace(4, adapt=False, member=0)
    assert [equal.step_in_period(s) for s in range(1, 9)] == [1, 2, 3, 4, 1, 2, 3, 4]
    assert equal.tick(3) == 3 and equal.reference(3) == 3.0
    slow = Pace(4, adapt=True, member=1)
    slow.steps = 2  # half as fast: two steps a period
    assert slow.step_in_period(1) == 1 and slow.reference(1) == 2.0 and slow.tick(1) is None
    slow.end_period(2)
    assert slow.tick(2) == 4 and slow.reference(3) == 6.0 and not slow.finished(3, 8)
    slow.end_period(4)
    assert slow.finished(4, 8)
    slow.restart_period(4)  # a failed sync: the period starts again at the restored step
    assert slow.step_in_period(5) == 1


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
