"""Starting, watching and stopping the groups a ClientApp launches on its own machine (local simulation), their
private directories, and liveness checks of local processes. Torch-free. A launched group is `python -m
torch.distributed.run --standalone --nproc-per-node R*S -m flwr_sharded.flower.group ...` in its own session, with a
fresh authkey in a private run directory; on a GPU machine each group gets R*S devices of its own, by partition id
(or the node config's `gpus`).
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.endpoint import GroupClient, GroupError, GroupUnavailable, read_authkey, write_authkey
from flwr_sharded.flower.messages import SHUTDOWN

logger = logging.getLogger(__name__)

GROUP_MODULE = "flwr_sharded.flower.group"
AUTHKEY_FILE, ADDRESS_FILE = "authkey", "address"
"""A launched group's key and endpoint address, in its private directory (what `remove_key_material` removes)."""


@dataclass
class LaunchedGroup:
    """A group this process started on the local machine."""

    pid: int
    """The torchrun launcher (leader of its own session)."""
    address: str
    authkey_file: str
    log_file: str
    run_dir: str
    worker_pids: list[int] = field(default_factory=list)
    """The ranks' pids, learned from the group's hello; killed by pid if the shutdown fails."""

    def to_record(self) -> dict[str, Any]:
        return asdict(self) | {"worker_pids": [int(p) for p in self.worker_pids]}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> LaunchedGroup:
        return cls(int(record["pid"]), str(record["address"]), str(record["authkey_file"]), str(record["log_file"]),
                   str(record["run_dir"]), [int(p) for p in record.get("worker_pids", [])])

    def client(self) -> GroupClient:
        return GroupClient(self.address, read_authkey(self.authkey_file))

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_file).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def private_dir(path: str | Path) -> Path:
    """`path` as a directory only this user can enter, made with mode 700 if missing (its parent must exist). An
    existing one must be a real directory of this user's that nobody else may write to (they could swap its keys or
    shards; ConfigError); one that others may read is made 700."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path} exists and is not a directory (a link or a file); remove it or choose another")
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ConfigError(f"directory {path} is not private to this user (owner uid {info.st_uid}, mode "
                          f"{info.st_mode & 0o777:03o}: others may write to it); use a directory of your own with "
                          f"mode 700 or remove it")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def fresh_private_dir(prefix: str, parent: str | Path | None = None) -> str:
    """A new directory (`mkdtemp`: mode 700, never one that existed) under `parent` (default: the temp dir)."""
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=None if parent is None else str(parent))
    except OSError as exc:
        raise ConfigError(f"cannot make a private directory under {parent or tempfile.gettempdir()}: {exc}; it must "
                          f"be an existing directory this user can write to") from None


def default_run_root() -> Path:
    """This user's directory for launched groups in the temp dir; refused (ConfigError) unless it is private."""
    return private_dir(Path(tempfile.gettempdir()) / f"flwr_sharded-{os.getuid()}")


# ----------------------------------------------------------------------------------------------------- GPUs

def remove_key_material(run_id: int, root: Path | None = None) -> list[Path]:
    """Remove the authkey and address files of run `run_id`'s groups launched on this machine (`root`: the default
    run root), and each node directory (and the run's) that is then empty; a group's log there stays. Returns the
    files removed."""
    run = (root or default_run_root()) / f"run-{run_id}"
    removed = []
    for node in sorted(run.glob("node-*")):
        for name in (AUTHKEY_FILE, ADDRESS_FILE):
            path = node / name
            if path.is_file():
                path.unlink()
                removed.append(path)
        for directory in (node, run):
            try:
                directory.rmdir()
            except OSError:  # not empty (a log, another node), or gone
                pass
    return removed


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The CUDA devices this machine offers a launched group: `CUDA_VISIBLE_DEVICES` if set (and not emptied by
    Ray for a CPU-only actor), else every GPU the NVIDIA driver lists; [] without GPUs."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",") if d.strip()]
    driver = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(driver.iterdir())))] if driver.is_dir() else []


def assign_gpus(partition_id: int, ranks: int, gpus: list[str], requested: str = "") -> list[str]:
    """The devices of one group: `requested` (a node config's comma-separated list) if given, else the
    partition's own block of `ranks` devices; [] on a machine without GPUs. ConfigError if they do not exist."""
    if requested:
        chosen = [d.strip() for d in requested.split(",") if d.strip()]
        unknown = [d for d in chosen if d not in gpus]
        if len(chosen) != ranks or unknown:
            raise ConfigError(f"node config gpus={requested!r}: a group of {ranks} ranks needs {ranks} distinct "
                              f"devices among the visible ones {gpus}" + (f"; {unknown} are not visible" if unknown
                                                                          else ""))
        return chosen
    if not gpus:
        return []
    first = partition_id * ranks
    if first + ranks > len(gpus):
        raise ConfigError(f"the group of partition {partition_id} needs {ranks} GPU(s) of its own (devices "
                          f"{first}..{first + ranks - 1}), but this machine shows {len(gpus)}: run fewer or smaller "
                          f"groups per machine, or give each SuperNode its devices with node config gpus=\"...\"")
    return gpus[first:first + ranks]


# ------------------------------------------------------------------------------------------- start and stop

def pid_alive(pid: int) -> bool:
    """True if `pid` runs (zombies count as gone; our own exited children are reaped)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def exit_with_parent() -> None:
    """Exit this process as soon as its parent (a rank's torchrun agent) is gone: no orphaned ranks after `kill -9`."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def launch_group(run_dir: str | Path, *, method: str, replicas: int, shards: int, idle_timeout: float = 600.0,
                 watch_pid: int | None = None, data_dir: str = "", ready_timeout: float = 180.0,
                 gpus: list[str] | None = None, python: str = sys.executable,
                 env: Mapping[str, str] | None = None, log_file: str | Path | None = None) -> LaunchedGroup:
    """Start a group of R*S local ranks and wait until its endpoint listens; returns how to reach and stop it.
    `run_dir`: its private directory (key, address); `log_file`: its log (default `run_dir/group.log`)."""
    run_dir = Path(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    private_dir(run_dir)  # its key and log: refused if someone else made or can enter it
    authkey_file, address_file = run_dir / AUTHKEY_FILE, run_dir / ADDRESS_FILE
    log_file = Path(log_file) if log_file else run_dir / "group.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    write_authkey(authkey_file)
    address_file.unlink(missing_ok=True)
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(replicas * shards),
           "-m", GROUP_MODULE, "--authkey-file", str(authkey_file), "--address", "127.0.0.1:0",
           "--address-file", str(address_file), "--method", method, "--replicas", str(replicas),
           "--shards", str(shards), "--idle-timeout", str(idle_timeout)]
    if watch_pid:
        cmd += ["--watch-pid", str(watch_pid)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if gpus:
        full_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    elif full_env.get("CUDA_VISIBLE_DEVICES") == "":  # Ray hides GPUs from CPU-only actors; the group needs them
        del full_env["CUDA_VISIBLE_DEVICES"]
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    group = LaunchedGroup(pid=proc.pid, address="", authkey_file=str(authkey_file), log_file=str(log_file),
                          run_dir=str(run_dir))
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if address_file.is_file():
            group.address = address_file.read_text().strip()
            logger.info("launched group pid %d at %s%s (log %s)", proc.pid, group.address,
                        f" on GPUs {','.join(gpus)}" if gpus else "", log_file)
            return group
        if proc.poll() is not None:
            raise GroupUnavailable(f"the group exited during start-up (code {proc.returncode}); "
                                   f"{log_file}:\n{group.log_tail()}")
        time.sleep(0.2)
    stop_group(group, graceful=False)
    raise GroupUnavailable(f"the group did not listen within {ready_timeout:.0f} s; {log_file}:\n{group.log_tail()}")


def _is_group_process(pid: int) -> bool:
    """Guard against pid reuse: only kill processes whose command line is a group's."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return GROUP_MODULE in cmdline


def stop_group(group: LaunchedGroup, *, graceful: bool = True, timeout: float = 30.0) -> bool:
    """Shut a launched group down: the shutdown verb, then SIGTERM, then SIGKILL by pid. True if all exited."""
    if graceful and pid_alive(group.pid) and group.address:
        try:
            group.client().call(SHUTDOWN, timeout=min(timeout, 10.0))
        except (GroupUnavailable, GroupError, ConfigError) as exc:
            logger.warning("shutdown of group %s: %s", group.address, exc)
    pids = [group.pid, *group.worker_pids]
    deadline = time.monotonic() + timeout
    for sig, wait in ((None, timeout / 2), (signal.SIGTERM, timeout / 4), (signal.SIGKILL, timeout / 4)):
        if sig is not None:
            for pid in pids:
                if pid_alive(pid) and (pid == group.pid or _is_group_process(pid)):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        end = min(deadline, time.monotonic() + wait)
        while time.monotonic() < end and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        if not any(pid_alive(p) for p in pids):
            return True
    return not any(pid_alive(p) for p in pids)
