"""A Flower deployment on loopback, process by process (SuperLink, SuperNodes, group torchrun jobs, `flwr run`), for
measurements and tests: every process in its own session, every wait bounded, every kill by pid.

`Procs` records what is started and `close()` kills all of it (process groups first, then any pid still alive) -
call it in a `finally`. Torch-free.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from flwr_sharded.flower.launch import pid_alive

VENV_BIN = Path(sys.executable).parent
"""The environment's scripts (flwr, flower-superlink, torchrun): put in front of PATH."""


LOWEST_PORT = 20000


def free_port() -> int:
    """A port free on 127.0.0.1, chosen at random below the kernel's ephemeral range (ip_local_port_range): no
    connection's source port and no bind to port 0 (torchrun's store, gloo, a group's endpoint) can take it
    between this choice and the server's own bind, as one the kernel handed out could be."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    below = range(LOWEST_PORT, ephemeral_low)
    candidates = [secrets.choice(below) for _ in range(50)] if below else []
    for port in [*candidates, 0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def run_config_args(values: dict) -> list[str]:
    """`--run-config` options for `flwr run`, one key each (strings quoted as TOML)."""
    out = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value)
        else:
            text = repr(value)
        out += ["--run-config", f"{key}={text}"]
    return out


def write_flwr_home(home: Path, connection: str, address: str, **options: str | bool) -> Path:
    """A FLWR_HOME whose config.toml names one SuperLink connection (the default of `flwr run`)."""
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f"default = {json.dumps(connection)}", "", f"[superlink.{connection}]",
             f"address = {json.dumps(address)}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in options.items()]  # JSON strings/bools are TOML
    (home / "config.toml").write_text("\n".join(lines) + "\n")
    return home


def base_env(**extra: str) -> dict[str, str]:
    """This environment with its scripts first on PATH, one thread per rank, no telemetry or update check, and no
    runtime dependency installation (the app needs none; this saves Flower's `uv sync`)."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "OMP_NUM_THREADS": "1",
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    env.update(extra)
    return env


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pids_matching(*needles: str) -> list[int]:
    """Pids whose command line contains every needle (for finding what a test's processes spawned)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            text = cmdline(int(entry.name))
            if text and all(n in text for n in needles):
                out.append(int(entry.name))
    return out


def pids_with_env(name: str, value: str) -> list[int]:
    """Pids whose environment holds name=value: everything a test's process tree spawned, whatever its session."""
    needle = f"{name}={value}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                out.append(int(entry.name))
    return out


def kill_tree_by_env(name: str, value: str, timeout: float = 30.0) -> int:
    """SIGKILL every process carrying name=value in its environment (repeatedly, until none is left)."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = pids_with_env(name, value)
        if not pids:
            return len(killed)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    raise TimeoutError(f"processes with {name}={value} still alive after {timeout:.0f} s: {pids_with_env(name, value)}")


def wait_until(predicate, timeout: float, interval: float = 0.2, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"{what} not met within {timeout:.0f} s")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Procs:
    """Starts processes in their own sessions with logs under `workdir`; `close()` kills them all."""

    workdir: Path
    procs: list[Proc] = field(default_factory=list)
    extra_pids: set[int] = field(default_factory=set)

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as fh:
            popen = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                     env=env or base_env(), cwd=cwd, start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def track(self, *pids: int) -> None:
        self.extra_pids.update(int(p) for p in pids)

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.popen.wait(timeout=15)

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.extra_pids:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def listens(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def launch_superlink(procs: Procs, port: int, env: dict[str, str], *options: str, name: str = "superlink") -> Proc:
    """Start `flower-superlink` on 127.0.0.1:`port` with its database `procs.workdir`/state.db (a restarted one
    finds its state); `options`: its TLS options (none: --insecure). `wait_listening` waits until it listens."""
    cmd = ["flower-superlink", *(options or ["--insecure"]), "--host", "127.0.0.1", "--port", str(port),
           "--disable-runtime-dependency-installation", "--database", str(procs.workdir / "state.db")]
    return procs.start(name, cmd, env=env)


def wait_listening(proc: Proc, port: int, timeout: float = 120.0) -> Proc:
    """`proc` once 127.0.0.1:`port` accepts connections; RuntimeError with its log if it exits first."""
    wait_until(lambda: proc.popen.poll() is not None or listens(port), timeout, 0.1, f"{proc.name} listening")
    if proc.popen.poll() is not None:
        raise RuntimeError(f"{proc.name} exited during start-up ({proc.popen.returncode}):\n{proc.text()[-3000:]}")
    return proc


def launch_group(procs: Procs, name: str, *, shards: int = 2, replicas: int = 1, method: str = "fl-fsdp",
                 idle_timeout: float = 300.0, extra: Sequence[str] = (), address: str = "127.0.0.1:0",
                 key: Path | None = None, env: dict[str, str] | None = None,
                 wrap: Sequence[str] = ()) -> tuple[Proc, Path, Path]:
    """Start a group torchrun job, as an operator would for a SuperNode; returns (proc, address file, authkey).
    `env`: variables added to `base_env()`; `wrap`: a command it runs under (e.g. `ip netns exec NAME`)."""
    from flwr_sharded.flower.endpoint import write_authkey

    if key is None:
        key = procs.workdir / f"{name}.key"
        write_authkey(key)
    address_file = procs.workdir / f"{name}.address"
    address_file.unlink(missing_ok=True)
    cmd = [*wrap, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(replicas * shards), "-m", "flwr_sharded.flower.group", "--authkey-file", str(key), "--address", address,
           "--address-file", str(address_file), "--method", method, "--replicas", str(replicas), "--shards",
           str(shards), "--idle-timeout", str(idle_timeout), *extra]
    return procs.start(name, cmd, env=base_env(**(env or {}))), address_file, key


def wait_group(proc: Proc, address_file: Path, timeout: float = 180.0) -> str:
    wait_until(lambda: address_file.is_file() or proc.popen.poll() is not None, timeout,
               what=f"{proc.name} listening")
    if not address_file.is_file():
        raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.text()[-3000:]}")
    return address_file.read_text().strip()


def start_group(procs: Procs, name: str, **kwargs) -> tuple[Proc, str, Path]:
    """One group, started and listening: (proc, address, authkey file)."""
    return start_groups(procs, [(name, kwargs)])[0]


def start_groups(procs: Procs, groups: Sequence[tuple[str, dict]]) -> list[tuple[Proc, str, Path]]:
    """Several groups started at once (their start-ups overlap), each listening: [(proc, address, authkey)]."""
    launched = [launch_group(procs, name, **kwargs) for name, kwargs in groups]
    return [(proc, wait_group(proc, address_file), key) for proc, address_file, key in launched]


def group_pids(address: str, key: Path) -> list[int]:
    from flwr_sharded.flower.endpoint import GroupClient, read_authkey

    return [int(p) for p in GroupClient(address, read_authkey(key)).call("status", timeout=30)["pids"]]


def deployment_rounds(procs: Procs, app: Path, groups: Sequence[tuple[str, dict]], config: dict, *,
                      timeout: float, node_env: dict[str, str] | None = None, node_config: str = "") -> list[dict]:
    """`flwr run app` on a loopback deployment started in `procs`: a SuperLink, the group jobs `groups` (as
    `start_groups`) and one SuperNode per group (partition id = its place); `config` is the run config (its run-dir is
    set here); `node_env`: variables added to the SuperNodes' environment; `node_config`: more of their node config
    (e.g. `allowed-checkpoint-root="/dir"`). Returns the run's round records;
    RuntimeError when it does not finish within `timeout` seconds, fails, or records another number of rounds than
    its num-server-rounds. The caller closes `procs`."""
    port = free_port()
    home = write_flwr_home(procs.workdir / "flwr_home", "bench", f"127.0.0.1:{port}", insecure=True)
    env = base_env(FLWR_HOME=str(home))
    superlink = launch_superlink(procs, port, env)
    started = start_groups(procs, groups)
    wait_listening(superlink, port)
    for i, (_, address, key) in enumerate(started):
        procs.start(f"supernode{i}", [
            "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
            "--node-config", f'group-address="{address}" group-authkey-file="{key}" partition-id={i} '
                             f'num-partitions={len(started)} {node_config}'.strip()], env={**env, **(node_env or {})})
    metrics = procs.workdir / "run" / "metrics.jsonl"
    run = procs.start("flwr-run", ["flwr", "run", str(app), "bench", "--stream",
                                   *run_config_args({**config, "run-dir": str(metrics.parent)})], env=env)
    try:
        run.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the run did not finish within {timeout} s:\n{run.text()[-3000:]}") from None
    rounds = round_records(metrics)
    if run.popen.returncode != 0 or len(rounds) != config["num-server-rounds"]:
        raise RuntimeError(f"the run failed ({run.popen.returncode}, {len(rounds)} rounds):\n{run.text()[-3000:]}")
    return rounds


def round_records(path: Path, kind: str = "round") -> list[dict]:
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)
