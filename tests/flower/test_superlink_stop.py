"""`flwr-sharded stop-superlink`: stops the local SuperLink of one Flower home and its SuperExec by pid, and leaves
another home's SuperLink running."""

from __future__ import annotations

import pytest
import os
import subprocess
import sys
from pathlib import Path

from flwr_sharded.cli import main
from flwr_sharded.flower.launch import pid_alive
from flwr_sharded.flower.superlink import stop_superlink, superexec_pids, superlink_pids

pytestmark = pytest.mark.dist  # every test here starts processes

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _start(*args: str) -> subprocess.Popen:
    """A sleeping process whose command line reads like a Flower process's (`args` after the sleeper)."""
    return subprocess.Popen([*SLEEPER, *args], start_new_session=True)


def test_stops_one_homes_superlink_and_superexec_only(tmp_path: Path, capsys, monkeypatch):
    home_a, home_b = tmp_path / "a", tmp_path / "b"
    started = []
    try:
        link_a = _start("flower-superlink", "--log-file", f"{home_a}/local-superlink/superlink.log")
        started.append(link_a)
        started.append(exec_a := _start("flower-superexec", "--plugin-type", "serverapp",
                                         "--parent-pid", str(link_a.pid)))
        started.append(link_b := _start("flower-superlink", "--log-file", f"{home_b}/local-superlink/superlink.log"))
        started.append(other := _start("flower-superexec", "--parent-pid", str(link_b.pid)))
        assert superlink_pids(home_a) == [link_a.pid] and superexec_pids(link_a.pid) == [exec_a.pid]

        monkeypatch.setenv("FLWR_HOME", str(home_b))  # the option wins over the environment
        assert main(["stop-superlink", "--flwr-home", str(home_a), "--timeout", "5"]) == 0
        out = capsys.readouterr().out
        assert f"pids {link_a.pid} {exec_a.pid}" in out and str(home_a) in out
        assert not pid_alive(link_a.pid) and not pid_alive(exec_a.pid)
        assert pid_alive(link_b.pid) and pid_alive(other.pid)

        assert main(["stop-superlink", "--flwr-home", str(home_a)]) == 0
        assert "no local SuperLink" in capsys.readouterr().err
        assert main(["stop-superlink", "--timeout", "-1"]) == 2
        assert "--timeout must be >= 0" in capsys.readouterr().err
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.wait()


def test_a_superlink_ignoring_sigterm_is_killed_after_the_timeout(tmp_path: Path):
    home = tmp_path / "home"
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); "
                "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", stubborn, "flower-superlink", "--log-file",
                             f"{home}/local-superlink/superlink.log"], stdout=subprocess.PIPE, start_new_session=True)
    try:
        proc.stdout.readline()  # SIGTERM is ignored from here on

        assert stop_superlink(home, timeout=0.5) == [proc.pid]
        assert not pid_alive(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()


def test_the_command_runs_without_torch(tmp_path: Path):
    """The demo script runs it at every exit: a fresh interpreter, no torch loaded."""
    probe = ("import sys; from flwr_sharded.cli import main; "
             "code = main(['stop-superlink', '--flwr-home', sys.argv[1]]); print(code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.stdout.split() == ["0", "False"], proc.stderr
    assert f"no local SuperLink of {tmp_path} is running" in proc.stderr
