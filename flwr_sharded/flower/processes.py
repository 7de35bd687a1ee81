"""Process liveness checks shared by the ClientApp side, the group runtime and the tests. Torch-free."""

from __future__ import annotations

import os
import threading
import time


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
    """Exit this process as soon as its parent (a rank's torchrun agent) is gone: no orphaned ranks after a
    `kill -9`."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()
