"""A SuperLink restart on a loopback deployment (SuperLink with a database, one SuperNode, one group): while the
group holds the trainer of a run whose ServerApp is gone, the SuperLink is killed and restarted; the SuperNode
reconnects on its own and a new run completes on the same group, whose hello replaces the dead run's trainer. (A
group that hears nothing more drops the run after its group-idle-timeout: tests/flower/test_liveness.py.) Everything
is started in its own session and killed at the end."""

from __future__ import annotations

import subprocess
import time

import pytest

from flwr_sharded.flower import messages as P
from tests.flower.procs import APP, FAST_RUN_CONFIG, base_env, free_port, launch_superlink, round_records, \
    run_config_args, start_group, strip_ansi, wait_listening, wait_until, write_flwr_home
from tests.flower.test_group import client, spec

RUN = {**FAST_RUN_CONFIG, "num-groups": 1, "shards": 1, "round-timeout": 40.0, "hello-timeout": 40.0,
       "rendezvous-timeout": 3.0, "sync-timeout": 3.0, "finish-timeout": 10.0, "group-idle-timeout": 85.0}


# A whole second `flwr run` (about a minute on 2 cores): outside the default suite, which has to fit CI's time.
pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_after_a_superlink_restart_the_supernode_reconnects_and_a_new_run_completes(procs, data_dir):
    port = free_port()
    home = write_flwr_home(procs.workdir / "flwr_home", "loopback", f"127.0.0.1:{port}", insecure=True)
    env = base_env(FLWR_HOME=str(home))
    superlink = launch_superlink(procs, port, env)
    group, address, key = start_group(procs, "group", shards=1, idle_timeout=300)
    wait_listening(superlink, port)
    supernode = procs.start("supernode", [
        "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
        "--node-config", f'group-address="{address}" group-authkey-file="{key}" partition-id=0 num-partitions=1 '
                         f'allowed-save-root="{procs.workdir}"'],  # the runs' directories (and models) are under it
        env=env)

    def flwr_run(name: str, config: dict) -> tuple[subprocess.Popen, object]:
        metrics = procs.workdir / f"{name}-run" / "metrics.jsonl"
        cmd = ["flwr", "run", str(APP), "loopback", "--stream",
               *run_config_args({**config, "data-dir": str(data_dir), "run-dir": str(metrics.parent)})]
        return procs.start(f"flwr-run-{name}", cmd, env=env), metrics

    # the group holds a run's trainer whose ServerApp is gone (a hello straight to its endpoint, as such a run
    # leaves it; a whole flwr run would cost a minute more), and the SuperNode is connected
    dead = client(address, key).call(P.HELLO, {"run": spec(data_dir, shards=1).to_json(), "run_key": "dead-run",
                                               "partition_id": 0, "num_partitions": 1}, timeout=120)
    assert dead["compatible"], dead["error"]
    wait_until(lambda: "SuperNode ID:" in supernode.text(), 120, 0.2, "the SuperNode connected")
    procs.kill(superlink)  # SIGKILL of its session
    time.sleep(1.0)
    start = time.monotonic()
    wait_listening(launch_superlink(procs, port, env, name="superlink-again"), port, timeout=60)
    second, metrics2 = flwr_run("after-restart", {**RUN, "num-server-rounds": 1})
    try:
        second.popen.wait(timeout=300)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the run after the restart did not finish:\n{strip_ansi(second.text())[-5000:]}")
    took = time.monotonic() - start
    rounds = round_records(metrics2)
    assert len(rounds) == 1 and rounds[0]["groups"] == 1, strip_ansi(second.text())[-5000:]
    assert group.popen.poll() is None and supernode.popen.poll() is None  # the same group and SuperNode
    assert group.text().count("built the trainer") == 2  # the new run's hello replaced the dead run's trainer
    print(f"\nSuperLink restart: the SuperNode reconnected by itself and a new 1-round run on the same group "
          f"completed {took:.1f} s after the SuperLink was restarted")
