"""`flwr run apps/llama_fl_hsdp --stream` exactly as a Flower user types it: Flower's default federation (2 simulated
SuperNodes, 2 CPUs per ClientApp, so one ClientApp at a time on this 2-core machine), runtime dependency
installation on, a fresh Flower home, run from a directory of the user's, with one of the app's own strategies
(`--run-config 'strategy="llama_fl_hsdp.strategies.fedprox:FedProxShards"'`, nothing on PYTHONPATH for it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.flower.procs import APP, base_env, free_port, kill_tree_by_env, pid_alive, pids_matching, \
    run_config_args, strip_ansi

pytestmark = pytest.mark.dist  # every test here starts processes

SMALL = {"seq-len": 32, "batch-size": 2, "eval-blocks": 8, "aggregate-every": 4, "syncs-per-round": 2,
         "num-server-rounds": 2, "seed": 7}
STRATEGY = "llama_fl_hsdp.strategies.fedprox:FedProxShards"
"""As docs/flower.md and the strategy's docstring give it: shipped with the app, imported from it by the ServerApp."""


def _flwr_run(cwd: Path, env: dict[str, str], run_config: dict, timeout: float) -> tuple[int, str]:
    proc = subprocess.run(["flwr", "run", str(APP), "--stream", *run_config_args(run_config)], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          start_new_session=True)
    return proc.returncode, strip_ansi(proc.stdout)


@pytest.mark.timeout(900)
def test_flwr_run_as_typed_completes_and_leaves_a_run_directory(data_dir, tmp_path):
    home, work = tmp_path / "flwr_home", tmp_path / "work"
    work.mkdir()
    env = base_env(FLWR_HOME=str(home), FLWR_SHARDED_DATA=str(data_dir),
                   FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()), FLWR_LOCAL_CONTROL_API_PORT=str(free_port()))
    del env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"]  # Flower's default: it `uv sync`s the app's dependencies
    try:
        code, out = _flwr_run(work, env, {**SMALL, "strategy": STRATEGY}, timeout=600)
        assert code == 0, out[-5000:]
        assert "Starting FedProxShards:" in out, out[-5000:]
        assert "Runtime installation of app dependencies failed" not in out and "App dependencies installed" in out
        assert "2 simulated SuperNodes" in out and "[ROUND 2/2] 2 group(s)" in out, out[-5000:]
        assert "flwr_sharded: the run COMPLETED: 2 round(s)" in out, out[-5000:]
        (run_dir,) = (work / "outputs").iterdir()  # outputs/<date>_<time>-run<id> in the user's directory
        assert str(run_dir) in out
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["rounds"] == 2
        assert json.loads((run_dir / "config.json").read_text())["federation"]["strategy"] == STRATEGY
        rounds = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                  if r["kind"] == "round"]
        assert [r["round"] for r in rounds] == [1, 2] and all(r["synced"] and r["checksums_equal"] for r in rounds)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
        assert model.config.num_hidden_layers == 2 and summary["model"] == str(run_dir / "model")
        logs = sorted(p.name for p in (run_dir / "groups").iterdir())  # the groups log to the run directory
        assert logs == ["group-0.log", "group-1.log"] and all(f"{run_dir}/groups/{n}" in out for n in logs), logs
        assert "hello" in (run_dir / "groups" / "group-0.log").read_text()
        from flwr_sharded.flower.launch import default_run_root

        assert not (default_run_root() / f"run-{run_dir.name.rsplit('-run', 1)[1]}").exists()  # keys removed
        time.sleep(1)
        assert pids_matching("flwr_sharded.flower.group", f"run-{run_dir.name.rsplit('-run', 1)[1]}/") == []

        # a bad value: a message naming the key, the run marked failed, no group started
        code, out = _flwr_run(work, env, {**SMALL, "lr": -1.0}, timeout=300)
        assert "run config 'lr' must be > 0, got -1.0" in out, out[-3000:]
        assert "flwr_sharded: the run FAILED before it started" in out and "hello to" not in out

        # a module outside the ServerApp's allow-list: refused by name before it is imported
        code, out = _flwr_run(work, env, {**SMALL, "strategy": "this:X"}, timeout=300)
        assert "run config 'strategy' 'this:X'" in out and "FLWR_SHARDED_ALLOWED_IMPORTS=this" in out, out[-3000:]
        assert "the run FAILED before it started" in out and "Beautiful is better than ugly" not in out

        # a model the groups would refuse: named once, as the run config spells it, before any group is launched
        code, out = _flwr_run(work, env, {**SMALL, "model": "smal"}, timeout=300)
        assert "flwr_sharded: the run FAILED before it started: run config 'model': unknown model 'smal'" in out, \
            out[-3000:]
        assert "--model" not in out and "hello to" not in out and out.count("unknown model 'smal'") <= 2  # + Flower's
    finally:
        kill_tree_by_env("FLWR_HOME", str(home))  # the local SuperLink `flwr run` started, and anything it left


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flwr_stop_leaves_no_process_of_the_run_and_says_the_run_was_stopped(data_dir, tmp_path):
    """`flwr run apps/llama_fl_hsdp --stream` of 100 rounds, stopped with `flwr stop <run-id>` in round 2: within
    30 s no process of the run is left (the simulation process, Ray's GCS, raylet, dashboard and its two agents,
    the ClientApp actor, both groups' launchers and ranks; only the local SuperLink and its SuperExec stay, as after
    any run), the run directory's summary.json says `stopped`, and the groups' key material under the temp dir is
    gone."""
    from flwr_sharded.flower.launch import AUTHKEY_FILE, default_run_root
    from tests.flower.procs import cmdline, pids_with_env

    home, work = tmp_path / "flwr_home", tmp_path / "work"
    work.mkdir()
    env = base_env(FLWR_HOME=str(home), FLWR_SHARDED_DATA=str(data_dir),
                   FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()), FLWR_LOCAL_CONTROL_API_PORT=str(free_port()))
    log = tmp_path / "run.log"
    with open(log, "w") as fh:
        run = subprocess.Popen(["flwr", "run", str(APP), "--stream", *run_config_args({**SMALL,
                                                                                       "num-server-rounds": 100})],
                               cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "[ROUND 2/100]" not in strip_ansi(log.read_text(errors="replace")):
            assert run.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.5)
        (run_id,) = re.findall(r"Successfully started run (\d+)", strip_ansi(log.read_text(errors="replace")))
        keys = default_run_root() / f"run-{run_id}"
        assert len(list(keys.glob(f"node-*/{AUTHKEY_FILE}"))) == 2
        of_the_run = [p for p in pids_with_env("FLWR_HOME", str(home)) if "flower-super" not in cmdline(p)]
        assert any("ray::" in cmdline(p) for p in of_the_run) and any("flwr_sharded.flower.group" in cmdline(p)
                                                                     for p in of_the_run)
        stop = subprocess.run(["flwr", "stop", run_id], cwd=work, env=env, capture_output=True, text=True,
                              timeout=120)
        assert stop.returncode == 0 and "successfully stopped" in stop.stdout, stop.stdout + stop.stderr
        stopped_at = time.monotonic()
        left = of_the_run
        while left and time.monotonic() < stopped_at + 30:
            time.sleep(0.5)
            left = [p for p in of_the_run if pid_alive(p)]
        assert not left, [cmdline(p)[:120] for p in left]
        gone_s = time.monotonic() - stopped_at
        assert run.wait(timeout=30) is not None  # `flwr run --stream` ended with its run
        (run_dir,) = (work / "outputs").iterdir()
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "stopped" and "flwr stop" in summary["error"], summary
        assert not keys.exists()
        print(f"\nflwr stop: no process of the run left {gone_s:.1f} s after `flwr stop` returned")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        kill_tree_by_env("FLWR_HOME", str(home))
