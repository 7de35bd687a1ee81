"""A SuperLink restart on a loopback deployment (SuperLink with a database, one SuperNode, one group): the SuperLink
and its ServerApp are killed mid-run; the group drops the dead run within its group-idle-timeout (freeing its
memory instead of holding it for the next hello), the SuperNode reconnects to the restarted SuperLink on its own,
and a new run completes on the same group. Everything is started in its own session and killed at the end."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests.flower.procs import APP, FAST_RUN_CONFIG, base_env, free_port, round_records, run_config_args, \
    start_group, strip_ansi, wait_until, write_flwr_home

IDLE_S = 85.0
"""The run's group-idle-timeout (above round-timeout + hello-timeout, as validated)."""
RUN = {**FAST_RUN_CONFIG, "num-groups": 1, "shards": 1, "round-timeout": 40.0, "hello-timeout": 40.0,
       "rendezvous-timeout": 3.0, "sync-timeout": 3.0, "finish-timeout": 10.0, "group-idle-timeout": IDLE_S}


@pytest.mark.timeout(600)
def test_a_superlink_restart_frees_the_dead_run_and_the_supernode_reconnects(procs, data_dir):
    port = free_port()
    home = write_flwr_home(procs.workdir / "flwr_home", "loopback", f"127.0.0.1:{port}", insecure=True)
    env = base_env(FLWR_HOME=str(home))
    superlink_cmd = ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port),
                     "--disable-runtime-dependency-installation", "--database", str(procs.workdir / "state.db")]
    superlink = procs.start("superlink", superlink_cmd, env=env)
    group, address, key = start_group(procs, "group", shards=1, idle_timeout=300)
    supernode = procs.start("supernode", [
        "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
        "--node-config", f'group-address="{address}" group-authkey-file="{key}" partition-id=0 num-partitions=1'],
        env=env)

    def flwr_run(name: str, config: dict) -> tuple[subprocess.Popen, object]:
        metrics = procs.workdir / f"{name}-run" / "metrics.jsonl"
        cmd = ["flwr", "run", str(APP), "loopback", "--stream",
               *run_config_args({**config, "data-dir": str(data_dir), "run-dir": str(metrics.parent)})]
        return procs.start(f"flwr-run-{name}", cmd, env=env), metrics

    first, metrics = flwr_run("long", {**RUN, "num-server-rounds": 50})
    wait_until(lambda: round_records(metrics) or first.popen.poll() is not None, 300, 0.2, "round 1 recorded")
    assert round_records(metrics), first.text()[-3000:]
    procs.kill(superlink)  # SIGKILL of its session: the SuperLink and the run's ServerApp
    killed = time.monotonic()
    procs.kill(first)
    time.sleep(2.0)
    procs.start("superlink-again", superlink_cmd, env=env)
    wait_until(lambda: "dropping the run" in group.text(), IDLE_S + 60, 0.2, "the group dropped the dead run")
    dropped_s = time.monotonic() - killed
    assert group.popen.poll() is None and supernode.popen.poll() is None  # the run dropped; both still serve
    match = re.search(r"no instruction for (\d+) s \(group-idle-timeout (\d+) s", group.text())
    assert match and int(match.group(2)) == IDLE_S and int(match.group(1)) < IDLE_S + 5

    start = time.monotonic()  # the SuperNode reconnected by itself: a new run finds it and completes
    second, metrics2 = flwr_run("after-restart", {**RUN, "num-server-rounds": 1})
    try:
        second.popen.wait(timeout=300)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the run after the restart did not finish:\n{strip_ansi(second.text())[-5000:]}")
    rounds = round_records(metrics2)
    assert len(rounds) == 1 and rounds[0]["groups"] == 1, strip_ansi(second.text())[-5000:]
    print(f"\nSuperLink restart: the group dropped the dead run {dropped_s:.1f} s after the kill (group-idle-timeout "
          f"{IDLE_S:.0f} s); with the SuperLink back after 2 s, a new 1-round run on the same SuperNode and group "
          f"completed {time.monotonic() - start:.1f} s after it was submitted")
