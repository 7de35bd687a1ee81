"""Where a benchmark's figures came from, written into every result file so that each figure can be rerun as printed:
the command as typed, the commit (and whether the tree differed from it), the date, and the machine and its load.
Torch-free."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, as it can be typed again from the repository root: a script by its path relative to
    the repository (`python benchmarks/x.py ...`), a console script by its name (`flwr-sharded bench ...`)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    if script.suffix == ".py":
        try:
            head = ["python", script.resolve().relative_to(REPO).as_posix()]
        except ValueError:
            head = ["python", str(script)]
    else:
        head = [script.name]
    return shlex.join([*head, *argv[1:]])


def head_commit() -> dict[str, Any]:
    """The repository's HEAD (short hash) and whether tracked files differed from it; empty where git is not."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "--short", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "", "dirty": None}


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """{"command", "commit", "dirty", "date", "load", "cpus", "python", "torch"}: what a result file records of the
    run that produced it (`load`: the 1, 5 and 15 minute load averages when it was called)."""
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:  # noqa: BLE001 - reported as unknown
        torch_version = ""
    return {"command": command_line(argv), **head_commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch_version}
