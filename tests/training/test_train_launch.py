"""`flwr-sharded train` without torchrun: a one-process run trains in a world of its own, a larger one stops before
any work with the torchrun command to type."""

from __future__ import annotations

import pytest
import json
import os
import subprocess
import sys

from tests import REPO

pytestmark = pytest.mark.dist  # every test here starts processes

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def flwr_sharded_train(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """`flwr-sharded train ARGS` as a user types it, outside torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "flwr_sharded.cli", "train", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def test_a_run_of_several_processes_names_the_torchrun_command(tmp_path):
    run_dir = tmp_path / "run dir"
    args = ["--method", "fl-fsdp", "--federations", "2", "--shards", "2", "--model", "tiny", "--run-dir", str(run_dir)]
    proc = flwr_sharded_train(*args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "flwr-sharded: error: this run needs F x R x S = 2 x 1 x 2 = 4 processes; launch it with: torchrun "
        f"--nproc-per-node 4 -m flwr_sharded.train --method fl-fsdp --federations 2 --shards 2 --model tiny "
        f"--run-dir '{run_dir}'"], proc.stderr
    assert proc.stdout == "" and not run_dir.exists()


def test_a_one_process_run_trains_without_torchrun(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = flwr_sharded_train("--method", "fsdp", "--shards", "1", "--model", "tiny", "--steps", "2", "--seq-len",
                              "32", "--batch-size", "1", "--eval-blocks", "2", "--no-save-model", "--no-progress",
                              "--run-dir", str(run_dir), "--data-dir", str(data_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2, summary
    assert (run_dir / "metrics.jsonl").read_text().strip()
