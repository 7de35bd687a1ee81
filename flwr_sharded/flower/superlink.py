"""`flwr-sharded stop-superlink [--flwr-home DIR]`: stop the local SuperLink that `flwr run` started for one Flower
home, and its SuperExec, by pid. Torch-free. They are found among the current user's processes by command line
(`flower-superlink ... --log-file <home>/local-superlink/superlink.log`, `flower-superexec ... --parent-pid <its
pid>`), never by name alone, so other users' and homes' SuperLinks are left alone: SIGTERM to each process group,
then SIGKILL after a bounded wait.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from flwr_sharded import schema
from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.launch import pid_alive
from flwr_sharded.schema import option

KILL_WAIT_S = 5.0
"""How long a SIGKILLed process may take to disappear."""


@dataclass
class StopOptions:
    """`flwr-sharded stop-superlink`: stop the local SuperLink of one Flower home and its SuperExec."""

    flwr_home: str | None = None
    """Flower home whose local SuperLink to stop; unset: $FLWR_HOME, else Flower's default home (~/.flwr)."""
    timeout: float = option(10.0, ge=0)
    """Seconds to wait after SIGTERM before sending SIGKILL."""


def flwr_home(given: str | None = None) -> Path:
    """The Flower home: `given`, else $FLWR_HOME, else ~/.flwr (as `flwr` itself decides)."""
    return Path(given or os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser()


def _own_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of every process of the current user that can be read."""
    uid = os.getuid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:  # gone meanwhile
            continue
        if argv:
            yield int(entry.name), argv


def _runs(argv: list[str], program: str) -> bool:
    """Whether command line `argv` runs `program` (itself, or a script of that name under an interpreter)."""
    return any(os.path.basename(a) == program for a in argv)


def superlink_pids(home: str | Path) -> list[int]:
    """Pids of the `flower-superlink` processes of Flower home `home` (`<home>/local-superlink/` on their argv)."""
    path = Path(home).expanduser()
    marks = {f"{path}/local-superlink/", f"{path.absolute()}/local-superlink/"}
    return [pid for pid, argv in _own_processes()
            if _runs(argv, "flower-superlink") and any(m in " ".join(argv) for m in marks)]


def superexec_pids(parent: int) -> list[int]:
    """Pids of the `flower-superexec` processes launched by SuperLink `parent` (`--parent-pid <parent>`)."""
    return [pid for pid, argv in _own_processes()
            if _runs(argv, "flower-superexec")
            and any(a == "--parent-pid" and b == str(parent) for a, b in zip(argv, argv[1:]))]


def _signal(pid: int, sig: int) -> None:
    """`sig` to the process group `pid` leads, else to `pid` alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_superlink(home: str | Path, timeout: float = 10.0) -> list[int]:
    """Stop the local SuperLink(s) of Flower home `home` and their SuperExecs: SIGTERM to each process group, at
    most `timeout` seconds for them to exit, then SIGKILL. Returns the pids found (empty: none was running)."""
    pids = []
    for link in superlink_pids(home):
        pids += [link, *superexec_pids(link)]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    _wait_gone(pids, timeout)
    for pid in pids:
        if pid_alive(pid):
            _signal(pid, signal.SIGKILL)
    _wait_gone(pids, KILL_WAIT_S)
    return pids


def _wait_gone(pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `stop-superlink` sub-command (options: `StopOptions`)."""
    parser = subparsers.add_parser(
        "stop-superlink", help="stop the local SuperLink that `flwr run` left running for one Flower home",
        description="Stop, by pid, the local SuperLink that `flwr run` started for one Flower home, and its\n"
                    "SuperExec: SIGTERM to each process group, SIGKILL after --timeout seconds.\n"
                    "Other users' and other homes' SuperLinks keep running.", formatter_class=schema.HelpFormatter)
    schema.add_arguments(parser, StopOptions)
    parser.set_defaults(func=_run_stop)


def _run_stop(args: argparse.Namespace) -> int:
    try:
        opts = schema.apply_arguments(StopOptions(), args)
    except ConfigError as exc:
        print(f"flwr-sharded stop-superlink: error: {exc}", file=sys.stderr)
        return 2
    home = flwr_home(opts.flwr_home)
    pids = stop_superlink(home, opts.timeout)
    if pids:
        print(f"flwr-sharded: stopped the local SuperLink of {home} (pids {' '.join(map(str, pids))})")
    else:
        print(f"flwr-sharded: no local SuperLink of {home} is running", file=sys.stderr)
    return 0
