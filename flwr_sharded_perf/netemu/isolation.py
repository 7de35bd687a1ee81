"""Running a command isolated from the host in fresh namespaces (root and tools checked), and what it could leave."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from flwr_sharded.errors import ConfigError

class EmulationError(ConfigError):
    """The emulated cluster cannot be built or run here; the message names the problem."""


INSIDE_ENV = "FLWR_SHARDED_NETEMU_INSIDE"
"""Set (to the outer process id) in the re-executed runner: it runs in the private namespaces."""
RANK_ENV = "FLWR_SHARDED_NETEMU_RANK"
"""Set in every rank an emulated network starts (to its rank)."""
TOOLS = {"unshare": "util-linux", "ip": "iproute2", "tc": "iproute2"}
"""Commands the emulator needs, and the package that provides each."""


def check_host(tools: Sequence[str] = tuple(TOOLS)) -> dict[str, str]:
    """Raise EmulationError unless we are root and every tool is on PATH; return {tool: path}."""
    if os.geteuid() != 0:
        raise EmulationError("the network emulation needs root (it creates network namespaces, bridges and tc "
                             f"qdiscs inside `unshare --net`); running as uid {os.geteuid()}: rerun with sudo")
    found = {tool: shutil.which(tool) for tool in tools}
    missing = [f"`{tool}` (package {TOOLS.get(tool, tool)})" for tool, path in found.items() if path is None]
    if missing:
        raise EmulationError(f"the network emulation needs {', '.join(missing)}, not found on PATH "
                             f"({os.environ.get('PATH', '')})")
    if not Path("/proc/self/ns/net").exists():
        raise EmulationError("this kernel has no network namespaces (/proc/self/ns/net is missing)")
    return found


def in_isolated_runner() -> bool:
    """True in the runner that `run_isolated` started (private network, mount and pid namespaces)."""
    return bool(os.environ.get(INSIDE_ENV)) and os.getpid() == 1


def run_isolated(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
                 capture: bool = False) -> subprocess.CompletedProcess:
    """Run `argv` as pid 1 of fresh network, mount and pid namespaces (`in_isolated_runner()` there), torn down by the
    kernel when it exits or this process dies; a timeout kills it and raises TimeoutError."""
    tools = check_host()
    cmd = [tools["unshare"], "--net", "--mount", "--pid", "--fork", "--kill-child", "--", *argv]
    full_env = {**os.environ, **(env or {}), INSIDE_ENV: str(os.getpid())}
    # `unshare` dies with this process (PR_SET_PDEATHSIG) and takes pid 1 of the namespaces with it (--kill-child):
    # the kernel then kills every process inside and frees the namespaces.
    proc = subprocess.Popen(cmd, env=full_env, start_new_session=True, text=True, preexec_fn=_die_with_parent,
                            stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise TimeoutError(f"the emulated run did not finish within {timeout} s and was killed"
                           + (f"\n{(err or '')[-3000:]}" if capture else ""))
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    """mount(2) directly: the `mount` command would create /run/mount (libmount's utab) on the host first."""
    if ctypes.CDLL(None, use_errno=True).mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
                   data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise EmulationError(f"mount {fstype} on {target} failed: {os.strerror(err)}")


MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8


def enter_private_run() -> None:
    """In the isolated runner: a private tmpfs on /run (for `ip netns`) and a /proc of the new pid namespace."""
    if not in_isolated_runner():
        raise EmulationError("enter_private_run() must run inside run_isolated() (pid 1 of a new pid namespace)")
    _mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # pid 1 ignores signals it has no handler for: turn SIGTERM into an exception so `finally` blocks run.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def host_leftovers() -> dict[str, list[str]]:
    """What an emulation could leave on the host if isolation failed: its namespaces, interfaces and processes."""
    out: dict[str, list[str]] = {"netns": [], "links": [], "processes": []}
    netns_dir = Path("/run/netns")
    if netns_dir.is_dir():
        out["netns"] = sorted(p.name for p in netns_dir.iterdir() if p.name.startswith("fsn"))
    try:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        links = ""
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(("fbg", "fbtop")) or (name[:2] in ("vn", "up", "dn") and name[2:].isdigit()):
            out["links"].append(name)
    for proc in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if INSIDE_ENV.encode() in environ or f"{RANK_ENV}=".encode() in environ:
            out["processes"].append(proc.name)
    return out


def _die_with_parent() -> None:
    """preexec: SIGKILL this process when the runner dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - best effort; the pid namespace kills it anyway
        pass
