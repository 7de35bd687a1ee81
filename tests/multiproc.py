"""Start the test worlds: a function on N local gloo ranks (`run_ranks`), the static engine's entry point on N ranks as
torchrun would run it (`train_ranks`), or torchrun itself (`torchrun`); every wait bounded, every process killed.

The ranks of `run_ranks` and `train_ranks` are forked from one server process per test session that imported torch
and transformers once (multiprocessing's forkserver, `PRELOAD`): a rank starts in milliseconds instead of re-importing
them (3-10 s of CPU per rank on this machine), and each starts from the same clean interpreter, with the caller's
environment and working directory. What `PRELOAD` reads from the environment at import (huggingface_hub's constants,
such as HF_HUB_OFFLINE) is the session's; torch's thread count follows the caller's OMP_NUM_THREADS (as at import).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

from tests import REPO
from tests.local_flower import free_port

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "transformers.models.llama.modeling_llama")
"""Imported once by the forkserver; the package itself is not (a rank imports it under the caller's environment)."""


ERROR_GRACE = 3.0
"""Seconds the other ranks have to report once one raised, before they are killed (they may wait on it)."""
FAILED_RANK_GRACE = 5.0
"""`train_ranks`: seconds between SIGTERM and SIGKILL of the other ranks once one failed."""


def _context() -> Any:
    """The forkserver context, its server started on first use with `PRELOAD` imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _as_caller(env: dict[str, str], cwd: str) -> None:
    """Give a forked rank the caller's environment and working directory (the server's are those of its start)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _worker(fn: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple,
            env: dict[str, str], cwd: str) -> None:
    _as_caller(env, cwd)
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


def _children_by_parent() -> dict[int, list[int]]:
    """Every running process's pid under its parent's (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return children


def children(pid: int) -> list[int]:
    """Direct children of `pid` (torchrun starts each worker in a session of its own: killpg misses them)."""
    return _children_by_parent().get(pid, [])


def _descendants(pids: Sequence[int]) -> list[int]:
    """Every process below `pids` (a forked child carries no marker of its own in its environment)."""
    children_of = _children_by_parent()
    found, todo = [], list(pids)
    while todo:
        below = children_of.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _stop(procs: Sequence[Any], grace: float = 0.0) -> None:
    """Stop whatever of `procs` (and of their descendants) still runs: SIGTERM and `grace` seconds to end, as
    torchrun's agent gives, then SIGKILL; reap them."""
    below = _descendants([p.pid for p in procs if p.pid is not None])
    if grace > 0:
        for p in procs:
            if p.is_alive():
                p.terminate()
        mp.connection.wait([p.sentinel for p in procs], timeout=grace)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call `fn(rank, world, *args)` on `world` processes; return the results ordered by rank.

    Raises RuntimeError with the workers' tracebacks if any of them raised (at once: the others are killed, since they
    may wait on it in a collective), TimeoutError if they did not all finish.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    caller = (dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, results, args, *caller), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(outcomes) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if any(s == "error" for s, _ in outcomes.values()):
                    break  # the others had their grace to report: they may wait on the failed rank
                raise TimeoutError(f"only ranks {sorted(outcomes)} of {world} finished within {timeout} s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
                outcomes[rank] = (status, value)
                if status == "error":
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
                if dead:
                    raise RuntimeError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
        for p in procs:
            p.join(timeout=5)
    finally:
        _stop(procs)
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


def _train_rank(rank: int, world: int, port: int, args: Sequence[str], env: dict[str, str], cwd: str,
                out: str, err: str) -> None:
    """One rank of `train_ranks`: `python -m flwr_sharded.train ARGS` with torchrun's environment, its output
    appended to `out`/`err`; exits with the entry point's status (interpreter exit: atexit handlers run)."""
    _as_caller(env, cwd)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                       "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    sys.stdout.flush(), sys.stderr.flush()
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [str(REPO / "flwr_sharded" / "train.py"), *args]
    import runpy

    import torch

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # what torch takes from it at import
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    code: int = 0
    try:
        if os.environ.get("FLWR_SHARDED_TEST_FAULTS"):  # what the faults' sitecustomize does at interpreter start
            runpy.run_path(str(FAULTS / "sitecustomize.py"), run_name="sitecustomize")
        runpy.run_module("flwr_sharded.train", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    import threading

    threading._shutdown()  # what an interpreter's exit does: its non-daemon threads joined, then atexit
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def train_ranks(nproc: int, args: Sequence[str], *, timeout: float = 300.0, env: dict[str, str] | None = None,
                cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """What `torchrun(nproc, args)` does, on ranks forked from the preloaded server: the same environment variables,
    return code (1 when a rank failed; the others are then stopped, as torchrun's agent does) and output (each
    rank's stdout and stderr, in rank order). For tests of the training, not of the launcher (those use `torchrun`)."""
    import tempfile

    ctx = _context()
    port = free_port()
    marker = f"{os.getpid()}-{uuid.uuid4().hex}"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), TREE_MARKER: marker}
    with tempfile.TemporaryDirectory(prefix="train-ranks-") as logs:
        files = [(os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err")) for r in range(nproc)]
        procs = [ctx.Process(target=_train_rank, args=(r, nproc, port, list(args), full_env, str(cwd or REPO),
                                                       *files[r])) for r in range(nproc)]
        for p in procs:
            p.start()
        returncode, deadline = 0, time.monotonic() + timeout
        try:
            while any(p.exitcode is None for p in procs):
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    returncode = 1  # torchrun's status when a rank failed (its ChildFailedError)
                    _stop(procs, grace=FAILED_RANK_GRACE)  # what is about to end may end by itself
                    break
                if time.monotonic() > deadline:
                    _stop(procs)
                    raise TimeoutError(f"train_ranks {' '.join(args)} timed out after {timeout} s\n"
                                       f"{_read(files, 1)[-4000:]}")
                mp.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.5)
            returncode = returncode or (1 if any(p.exitcode for p in procs) else 0)
        finally:
            _stop(procs)
            from tests.local_flower import kill_tree_by_env

            kill_tree_by_env(TREE_MARKER, marker)
        return subprocess.CompletedProcess(["train_ranks", str(nproc), *args], returncode, _read(files, 0),
                                           _read(files, 1))


def _read(files: Sequence[tuple[str, str]], which: int) -> str:
    """The ranks' stdout (0) or stderr (1), in rank order."""
    return "".join(Path(f[which]).read_text(errors="replace") if os.path.exists(f[which]) else "" for f in files)


CAN_EMULATE = os.geteuid() == 0 and all(shutil.which(t) for t in ("unshare", "ip", "tc"))
"""Whether the emulated network (`flwr_sharded_perf.netemu`) can run here."""
needs_emulation = pytest.mark.skipif(not CAN_EMULATE,
                                     reason="network emulation needs root with unshare, ip and tc")

FAULTS = REPO / "tests" / "faults"
"""The test-only fault hooks (`tests/faults/sitecustomize.py`), loaded by a process that has them on its path."""


def faults_env(**faults: object) -> dict[str, str]:
    """The environment that makes a launched world's (or group's) ranks inject `faults` (e.g. `fail_sync=2`,
    `step_delay="1:0.4"`, `lie="1e30@2"`): see `tests/faults/sitecustomize.py`."""
    return {"FLWR_SHARDED_TEST_FAULTS": " ".join(f"{k}={v}" for k, v in faults.items()),
            "PYTHONPATH": os.pathsep.join([str(FAULTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
