"""Run a function on N local gloo ranks (spawned processes), bounded by a timeout; every process is killed at the end."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        value = fn(rank, world, *args)
        results.put((rank, "ok", pickle.dumps(value)))  # plain pickle: no shared-memory handles to outlive us
    except BaseException as exc:  # reported to the parent, which fails the test
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call `fn(rank, world, *args)` on `world` processes; return the results ordered by rank.

    Raises RuntimeError with the workers' tracebacks if any of them raised, TimeoutError if they did not all finish.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, results, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(outcomes) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"only ranks {sorted(outcomes)} of {world} finished within {timeout} s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
                outcomes[rank] = (status, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
                if dead:
                    raise RuntimeError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {v}" for r, v in sorted(errors.items())))
    return [pickle.loads(outcomes[r][1]) for r in range(world)]


TREE_MARKER = "FLWR_SHARDED_TEST_TORCHRUN"
"""Environment variable marking every process of one `torchrun` call (its ranks included)."""


def torchrun(nproc: int, args: Sequence[str], *, timeout: float = 300.0, env: dict[str, str] | None = None,
             cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc -m flwr_sharded.train ARGS` in its own session; kill it all at the end,
    the ranks too (torchrun starts each in a process group of its own: they are found by an environment marker)."""
    from tests.local_flower import kill_tree_by_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), "-m", "flwr_sharded.train", *args]
    marker = f"{os.getpid()}-{uuid.uuid4().hex}"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), TREE_MARKER: marker}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            cwd=cwd or REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_tree_by_env(TREE_MARKER, marker)  # the ranks hold the pipes open: communicate would wait for them
        out, err = proc.communicate()
        raise TimeoutError(f"torchrun {' '.join(args)} timed out after {timeout} s\n{err[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_tree_by_env(TREE_MARKER, marker)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


FAULTS = REPO / "tests" / "faults"
"""The test-only fault hooks (`tests/faults/sitecustomize.py`), loaded by a process that has them on its path."""


def faults_env(**faults: object) -> dict[str, str]:
    """The environment that makes a launched world's (or group's) ranks inject `faults` (e.g. `fail_sync=2`,
    `step_delay="1:0.4"`, `lie="1e30@2"`): see `tests/faults/sitecustomize.py`."""
    return {"FLWR_SHARDED_TEST_FAULTS": " ".join(f"{k}={v}" for k, v in faults.items()),
            "PYTHONPATH": os.pathsep.join([str(FAULTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
