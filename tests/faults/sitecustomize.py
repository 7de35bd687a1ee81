"""Test-only faults, injected into the package's processes from outside (nothing in the package can fail on purpose).

Put this directory first on the PYTHONPATH of a static world's ranks (or of a group's) and set, space-separated,
`FLWR_SHARDED_TEST_FAULTS` (see `tests.multiproc.faults_env`):

- `fail_sync=N`: rank 0's N-th fragment sync attempt fails after its reduction succeeded everywhere (a blocking
  sync's at the commit vote; an overlapped sync's when its result arrives, before the merge);
- `collective_sync=1`: that failure is reported as a failed collective (a timeout, a lost peer), not a rejection;
- `no_rebuild=1`: the static engine's groups are taken for ones a failed collective leaves unusable (NCCL's);
- `nan_sync=N`: rank 0 brings NaN in its first shard and in its moments to its N-th sync attempt (admission, healing);
- `exit_after_syncs=N`: a group's ranks exit abruptly (code 17) once N periods' syncs were adopted;
- `step_delay=SECONDS` or `step_delay=G:SECONDS`: every rank (of federation group G) sleeps after each inner step;
- `commit_delay=SECONDS`: every rank sleeps between writing a checkpoint and committing it;
- `freeze_sync=N@RANK`: the rank whose RANK is RANK stops itself (SIGSTOP) inside its N-th fragment sync, after the
  admission (every member has entered the sync) and before its first bucket's reduction; the test sends SIGCONT;
- `hold_sync=N@RANK:SECONDS`: at the same point that rank logs "holds inside sync N" and sleeps SECONDS, then goes on
  (a test cuts the network meanwhile);
- `lie=VALUE@ATTEMPTS[@RANKS]` (several joined by ";", e.g. "1e30@2;nan@3,4"): before each listed sync attempt
  (1 = the first fragment sync this rank attempts) the rank overwrites that fragment's shards with VALUE (a number, or
  "x100": its own values times 100) and reports itself healthy whatever they hold, so admission admits it; RANKS
  (global ranks, comma-separated) limits the lie to those ranks of a static world. Everything else is the package's
  own code: the honest members, and the liar's own part of the vote and of the offender search.

The sync faults, the slowed steps and the exits are observers of every `SyncLoop` of the process
(`flwr_sharded.training.observer`); the lie's verdict is each fragment sync's `ShardSync.verdict`. `commit_delay`,
`no_rebuild`, `freeze_sync` and `hold_sync` replace a checkpointer's, the static engine's and a sync's function.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from flwr_sharded.training.observer import SyncObserver, observe_every_loop


def _lies(specs: str) -> dict[int, str]:
    lies: dict[int, str] = {}  # attempt -> value
    for spec in specs.split(";"):
        value, _, rest = spec.partition("@")
        attempts_text, _, ranks = rest.partition("@")
        if not ranks or os.environ.get("RANK", "0") in ranks.split(","):
            lies.update({int(a): value for a in attempts_text.split(",")})
    return lies


class SyncFaults(SyncObserver):
    """`fail_sync`, `collective_sync`, `nan_sync` and `lie`: one observer of every loop of the process (its counts
    are the process's)."""

    def __init__(self, faults: dict[str, str]) -> None:
        rank0 = os.environ.get("RANK", "0") == "0"
        self.faults, self.attempts, self.started, self.lying, self.failing = faults, 0, 0, False, False
        self.fail_sync = int(faults.get("fail_sync", 0)) if rank0 else 0
        self.nan_sync = int(faults.get("nan_sync", 0)) if rank0 else 0
        self.lies = _lies(faults["lie"]) if "lie" in faults else {}

    def verdict(self, *args):  # noqa: ANN002, ANN201 - `ShardSync.verdict`: healthy whatever it sends while lying
        from flwr_sharded.parallel.admission import healthy

        return True if self.lying else healthy(*args)

    def on_merge(self, loop, i):  # noqa: ANN001 - a merge (a blocking sync's start too) is one attempt
        self.attempts += 1
        if self.attempts == self.nan_sync:
            _nan(loop)
        self.failing = self.attempts == self.fail_sync
        if loop.schedule.delay == 0 and self.attempts in self.lies:
            _poison(loop, i, self.lies[self.attempts])
            self.lying = True

    def on_reduced(self, loop, i):  # noqa: ANN001 - the reduction arrived everywhere: rank 0's part fails here
        if self.failing:
            from flwr_sharded.parallel.collectives import CollectiveTimeout

            error = CollectiveTimeout if "collective_sync" in self.faults else RuntimeError
            raise error(f"injected fault: sync attempt {self.fail_sync} fails after the reduction")

    def on_outcome(self, loop, outcome):  # noqa: ANN001
        self.lying = self.failing = False

    def on_sync_start(self, loop, i):  # noqa: ANN001 - an overlapped sync's copy and verdict are taken here
        self.started += 1
        if self.started in self.lies:
            _poison(loop, i, self.lies[self.started])
            self.lying = True

    def on_sync_started(self, loop, i):  # noqa: ANN001
        self.lying = False


def _poison(loop, i: int, value: str) -> None:  # noqa: ANN001
    import torch

    from flwr_sharded.parallel.alignment import local_shard

    with torch.no_grad():
        for param in loop.syncs[i].params:
            shard = local_shard(param)
            shard.mul_(100.0) if value == "x100" else shard.fill_(float(value))


def _nan(loop) -> None:  # noqa: ANN001 - NaN in rank 0's first shard and in its moments
    import torch

    from flwr_sharded.parallel.alignment import local_shard

    with torch.no_grad():
        param = next(iter(loop.trainer.model.parameters()))
        local_shard(param).view(-1)[0] = float("nan")
        for value in loop.trainer.optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local_shard(value).fill_(float("nan"))


class SlowSteps(SyncObserver):
    """`step_delay`: every rank (of federation group `group`, None: of every group) sleeps after each inner step."""

    def __init__(self, group: int | None, seconds: float) -> None:
        self.group, self.seconds = group, seconds

    def on_step_end(self, loop, loss):  # noqa: ANN001 - within the step's time, as a slower device's step
        if self.group is None or loop.topo.fed_index == self.group:
            time.sleep(self.seconds)


class ExitAfterSyncs(SyncObserver):
    """`exit_after_syncs`: the loop's ranks exit abruptly (code 17) once `syncs` of its periods were adopted (a group's
    loop counts the periods since its trainer was built)."""

    def __init__(self, syncs: int) -> None:
        self.syncs, self.periods = syncs, 0

    def on_period_end(self, loop):  # noqa: ANN001
        self.periods += 1
        if self.periods >= self.syncs:
            logging.getLogger("flwr_sharded.group").error("injected fault: exiting after %d syncs", self.periods)
            sys.stderr.flush()
            os._exit(17)


def _install(faults: dict[str, str]) -> None:
    sync_faults = SyncFaults(faults)
    slow = None
    if "step_delay" in faults:
        group, _, seconds = faults["step_delay"].rpartition(":")
        slow = SlowSteps(int(group) if group else None, float(seconds))

    def observe(loop):  # noqa: ANN001, ANN202 - each new loop: its syncs take the faults' verdict
        for s in loop.syncs:
            s.verdict = sync_faults.verdict
        return sync_faults

    observe_every_loop(observe)
    if slow is not None:
        observe_every_loop(lambda loop: slow)
    if "exit_after_syncs" in faults:
        observe_every_loop(lambda loop: ExitAfterSyncs(int(faults["exit_after_syncs"])))

    if "no_rebuild" in faults:
        from flwr_sharded.training import static_run

        static_run.rebuildable = lambda group=None: False

    if "commit_delay" in faults:
        from flwr_sharded.training import checkpoint

        phase = checkpoint.Checkpointer._phase

        def slow_phase(self, what, tmp, action):  # noqa: ANN001
            if what == "committing":
                time.sleep(float(faults["commit_delay"]))
            return phase(self, what, tmp, action)

        checkpoint.Checkpointer._phase = slow_phase

    for name in ("freeze_sync", "hold_sync"):
        attempt, _, rest = faults.get(name, "").partition("@")
        rank, _, seconds = rest.partition(":")
        if attempt and os.environ.get("RANK", "0") == rank:
            _stop_in_sync(int(attempt), float(seconds) if name == "hold_sync" else None)


def _stop_in_sync(attempt: int, seconds: float | None) -> None:
    """This process stops itself (SIGSTOP; with `seconds`, sleeps that long) inside its `attempt`-th sync, once the
    admission returned (its peers are in the reduction, waiting for its part)."""
    import signal

    from flwr_sharded.parallel import sync

    admit, seen = sync.admit_channels, [0]

    def admit_then_stop(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        admissions = admit(*args, **kwargs)
        seen[0] += 1
        if seen[0] == attempt:
            what = "stops" if seconds is None else f"holds for {seconds:g} s"
            logging.getLogger("flwr_sharded.group").error("injected fault: rank %s %s inside sync %d",
                                                          os.environ.get("RANK"), what, attempt)
            sys.stderr.flush()
            if seconds is None:
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(seconds)
        return admissions

    sync.admit_channels = admit_then_stop


if os.environ.get("FLWR_SHARDED_TEST_FAULTS") and "LOCAL_RANK" in os.environ:
    _install(dict(item.split("=", 1) for item in os.environ["FLWR_SHARDED_TEST_FAULTS"].split()))
