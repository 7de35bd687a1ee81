"""A local simulation run of the default app (through the demo script), shared by the simulation and deployment
tests: it is the reference the deployment run and the static engine are compared with."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from flwr_sharded.flower.superlink import stop_superlink
from tests.flower.procs import DEMO, FAST_RUN_CONFIG, REPO, Procs, base_env, pids_matching, round_records, \
    run_config_args, strip_ansi, wait_until


@dataclass
class SimulationRun:
    returncode: int
    output: str
    rounds: list[dict]
    summary: list[dict]
    seconds: float
    flwr_home: Path
    run_id: str
    run_dir: Path


def run_demo(tmp: Path, data_dir: Path, run_config: dict, timeout: float = 420, groups: int = 2) -> SimulationRun:
    """`apps/llama_fl_hsdp/run_simulation.sh` with `--run-config` overrides and `groups` simulated SuperNodes; its
    own FLWR_HOME and ports."""
    home = tmp / "flwr_home"
    home.mkdir(parents=True, exist_ok=True)
    run_dir = tmp / "run"
    metrics = run_dir / "metrics.jsonl"
    env = base_env(FLWR_HOME=str(home), FLWR_SHARDED_DATA=str(data_dir), FLWR_SHARDED_GROUPS=str(groups))
    cmd = ["bash", str(DEMO), *run_config_args({"run-dir": str(run_dir), **run_config})]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script's trap stops its SuperLink
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        raise TimeoutError(f"the demo did not finish within {timeout} s:\n{strip_ansi(out)[-5000:]}")
    finally:
        _kill_leftovers(home)
    text = strip_ansi(out)
    match = re.search(r"Successfully started run (\d+)", text)
    return SimulationRun(proc.returncode, text, round_records(metrics), round_records(metrics, "summary"),
                         time.monotonic() - start, home, match.group(1) if match else "", run_dir)


def run_demo_killing_a_group(tmp: Path, data_dir: Path, run_config: dict, groups: int = 2,
                             member: int = 1) -> tuple[int, str, list[dict], str]:
    """The demo, with the processes of round 1's `member`-th group killed (`kill -9`) as soon as round 1 is
    recorded; returns (exit code, output, round records, the killed group's node id)."""
    import os
    import signal

    work = tmp / "run"
    work.mkdir(parents=True)
    metrics = work / "run" / "metrics.jsonl"
    env = base_env(FLWR_HOME=str(work / "flwr_home"), FLWR_SHARDED_DATA=str(data_dir),
                   FLWR_SHARDED_GROUPS=str(groups))
    cmd = ["bash", str(DEMO), *run_config_args({**run_config, "run-dir": str(work / "run")})]
    with open(work / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    try:
        wait_until(lambda: round_records(metrics) or proc.poll() is not None, 300, 0.05, "round 1")
        victim = round_records(metrics)[0]["members"][member]
        pids = pids_matching("flwr_sharded.flower.group", f"node-{victim}")
        assert pids, f"no group process found for member {member} (node {victim})"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        _kill_leftovers(work / "flwr_home")
    return proc.returncode, strip_ansi((work / "out.txt").read_text()), round_records(metrics), victim


def _kill_leftovers(home: Path) -> None:
    """Safety net: a SuperLink still running for this FLWR_HOME (the script should have stopped it)."""
    stop_superlink(home, timeout=0)


@pytest.fixture
def procs(tmp_path):
    """Processes a test starts (groups, SuperLink, SuperNodes), all killed at its end, failed or not."""
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="session")
def simulation_run(data_dir, tmp_path_factory) -> SimulationRun:
    """The default app in local simulation with small, fast settings (`FAST_RUN_CONFIG`), run once."""
    return run_demo(tmp_path_factory.mktemp("simulation"), data_dir, FAST_RUN_CONFIG)
