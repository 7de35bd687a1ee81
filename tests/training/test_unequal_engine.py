"""Groups that shard differently (`--group-shards`) through the real torchrun entry point, on gloo with a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.multiproc import faults_env, free_port
from tests.training.test_engine import FAILED_SYNC, SGD, _common, _records, _run, _state

pytestmark = pytest.mark.dist  # every test here starts processes


@pytest.mark.timeout(400)
def test_fl_fsdp_of_groups_of_2_and_4_shards_with_sgd_and_a1_equals_fsdp_on_6_ranks(data_dir, tmp_path):
    """Plain SGD, A = 1, no clipping: the groups' token-weighted mean of their updated shards (2 : 4) is one step on
    the mean gradient of all 6 ranks' batches, which the same 6 ranks read in both runs (1e-4 after 6 steps)."""
    _run(6, ["--method", "fl-fsdp", "--group-shards", "2,4", *SGD, "--log-every", "1",
             *_common(data_dir, tmp_path, "fl")])
    _run(6, ["--method", "fsdp", "--shards", "6", *SGD, "--log-every", "1", *_common(data_dir, tmp_path, "base")])
    fl_state, base_state = _state(tmp_path / "fl" / "model"), _state(tmp_path / "base" / "model")
    diffs = {k: float((fl_state[k] - base_state[k]).abs().max()) for k in fl_state}
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    start = _records(tmp_path / "fl", "start")[0]
    assert start["layout"].startswith("fl-fsdp: 2 groups of R=1 x (S=2, S=4)")
    losses = [r["loss"] for r in _records(tmp_path / "fl", "train")]
    assert losses == pytest.approx([r["loss"] for r in _records(tmp_path / "base", "train")], abs=1e-4)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05  # it trained: the weights moved beyond the tolerance


@pytest.mark.timeout(300)
def test_a_sync_that_fails_on_the_member_with_the_larger_s_is_rolled_back_everywhere(data_dir, tmp_path):
    """Group 0 (S = 2, ranks 0-1) fails its second sync after the reduction succeeded everywhere (injected on rank 0):
    both groups roll back to the first sync and go on; the run completes with the failure in its metrics."""
    assert FAILED_SYNC[:6] == ["--method", "fl-fsdp", "--federations", "2", "--shards", "1"]
    _run(3, ["--method", "fl-fsdp", *FAILED_SYNC[6:], "--group-shards", "2,1", *_common(data_dir, tmp_path, "retry")],
         env=faults_env(fail_sync=2))
    failed = _records(tmp_path / "retry", "sync_failed")
    assert [(r["step"], r["restored_step"], r["retry"]) for r in failed] == [(4, 2, 1)]
    train = _records(tmp_path / "retry", "train")
    assert [r["step"] for r in train] == [1, 2, 3, 3, 4, 5, 6] and train[-1]["syncs"] == 3


def _rank0_of(world: int, args: list[str]) -> subprocess.CompletedProcess:
    """Rank 0 of a world of `world` processes, alone (under torchrun the other ranks' exits may stop it before it
    prints its error)."""
    env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    return subprocess.run([sys.executable, "-m", "flwr_sharded.train", *args], env=env, capture_output=True,
                          text=True, timeout=100)


@pytest.mark.timeout(120)
def test_bad_group_shards_are_refused_before_any_process_starts(data_dir, tmp_path):
    result = _rank0_of(3, ["--method", "fl-fsdp", "--group-shards", "2,2,x", *_common(data_dir, tmp_path, "bad")])
    assert result.returncode == 2 and "--group-shards is a comma-separated list" in result.stderr, result.stderr
    assert not (tmp_path / "bad").exists()
    result = _rank0_of(5, ["--method", "fl-fsdp", "--group-shards", "2,4", *_common(data_dir, tmp_path, "bad")])
    assert result.returncode == 2 and "world size 5 != R*(S1+S2) = 1*(2+4) = 6" in result.stderr, result.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.timeout(300)
def test_group_steps_speed_gives_a_slower_group_fewer_steps_and_the_faster_one_less_idle_time(data_dir, tmp_path):
    """Group 1 sleeps 0.4 s after each step (several times a step's compute): with equal A the faster group idles
    about A x 0.4 s per sync; with --group-steps speed group 1 trains fewer steps from the second period on, and the
    faster group's idle time drops (medians; the exchange's records give both)."""
    common = ["--method", "fl-fsdp", "--group-shards", "1,2", "--aggregate-every", "4", "--steps", "16",
              "--eval-every", "0", "--no-save-model"]
    slow = faults_env(step_delay="1:0.4")
    _run(3, [*common, *_common(data_dir, tmp_path, "equal")], env=slow)
    _run(3, [*common, "--group-steps", "speed", *_common(data_dir, tmp_path, "speed")], env=slow)
    equal, speed = _records(tmp_path / "equal", "sync_groups"), _records(tmp_path / "speed", "sync_groups")
    assert [r["reference_step"] for r in speed] == [4, 8, 12, 16] == [r["step"] for r in equal]
    assert all(r["steps"] == [4, 4] for r in equal)
    assert speed[0]["steps"] == [4, 4] and all(r["steps"][0] == 4 and r["steps"][1] < 4 for r in speed[1:])
    assert speed[-1]["step"] == 16  # group 0's step count; group 1 took fewer
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    idle_equal = median([r["idle_s"][0] for r in equal[1:]])
    idle_speed = median([r["idle_s"][0] for r in speed[1:]])
    assert idle_equal > 1.0 and idle_speed < 0.5 * idle_equal, (idle_equal, idle_speed)
    assert _records(tmp_path / "speed", "eval")  # the run evaluated at its end, on the reference clock
