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
- `lie=VALUE@ATTEMPTS[@RANKS]` (several joined by ";", e.g. "1e30@2;nan@3,4"): before each listed sync attempt
  (1 = the first fragment sync this rank attempts) the rank overwrites that fragment's shards with VALUE (a number, or
  "x100": its own values times 100) and reports itself healthy whatever they hold, so admission admits it; RANKS
  (global ranks, comma-separated) limits the lie to those ranks of a static world. Everything else is the package's
  own code: the honest members, and the liar's own part of the vote and of the offender search.
"""

from __future__ import annotations

import os


def _lies(specs: str) -> dict[int, str]:
    lies: dict[int, str] = {}  # attempt -> value
    for spec in specs.split(";"):
        value, _, rest = spec.partition("@")
        attempts_text, _, ranks = rest.partition("@")
        if not ranks or os.environ.get("RANK", "0") in ranks.split(","):
            lies.update({int(a): value for a in attempts_text.split(",")})
    return lies


def _install(faults: dict[str, str]) -> None:
    import time

    import torch

    from flwr_sharded.parallel import sync
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.training import checkpoint, sync_loop, trainer

    rank0 = os.environ.get("RANK", "0") == "0"
    attempts, lying, failing = [0], [False], [False]
    fail_sync = int(faults.get("fail_sync", 0)) if rank0 else 0
    nan_sync = int(faults.get("nan_sync", 0)) if rank0 else 0
    lies = _lies(faults["lie"]) if "lie" in faults else {}

    honest = sync.healthy
    sync.healthy = lambda *args: True if lying[0] else honest(*args)

    @torch.no_grad()
    def poison(loop: sync_loop.SyncLoop, i: int, value: str) -> None:
        for param in loop.syncs[i].params:
            shard = local_shard(param)
            shard.mul_(100.0) if value == "x100" else shard.fill_(float(value))

    @torch.no_grad()
    def nan(loop: sync_loop.SyncLoop) -> None:
        param = next(iter(loop.trainer.model.parameters()))
        local_shard(param).view(-1)[0] = float("nan")
        for value in loop.trainer.optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local_shard(value).fill_(float("nan"))

    merge, start, agree = sync_loop.SyncLoop._merge, sync_loop.SyncLoop._start, sync_loop.SyncLoop._agree

    def faulty_merge(self, i, federation, apply_rule):  # noqa: ANN001 - the patched method's own arguments
        attempts[0] += 1
        if attempts[0] == nan_sync:
            nan(self)
        failing[0] = attempts[0] == fail_sync
        if self.schedule.delay == 0 and attempts[0] in lies:
            poison(self, i, lies[attempts[0]])
            lying[0] = True
        try:
            return merge(self, i, federation, apply_rule)
        finally:
            lying[0] = failing[0] = False

    started = [0]

    def faulty_start(self, i, federation):  # noqa: ANN001 - an overlapped sync's copy and verdict are taken here
        started[0] += 1
        if started[0] in lies:
            poison(self, i, lies[started[0]])
            lying[0] = True
        try:
            return start(self, i, federation)
        finally:
            lying[0] = False

    def faulty_agree(self, i, federation, mine, reached, outcome, broken=False):  # noqa: ANN001 - reached the end
        if failing[0] and reached:
            mine = (f"injected fault: sync attempt {fail_sync} fails after the reduction", [], False)
            broken = broken or "collective_sync" in faults
        return agree(self, i, federation, mine, reached, outcome, broken)

    receive = sync.ShardSync.receive

    def faulty_receive(self, **kwargs):  # noqa: ANN001 - an overlapped sync's result arrived everywhere
        receive(self, **kwargs)
        if failing[0] and self._received.thread is not None:
            from flwr_sharded.parallel.collectives import CollectiveTimeout

            error = CollectiveTimeout if "collective_sync" in faults else RuntimeError
            raise error(f"injected fault: sync attempt {fail_sync} fails after the reduction")

    sync_loop.SyncLoop._merge, sync_loop.SyncLoop._start, sync_loop.SyncLoop._agree = (faulty_merge, faulty_start,
                                                                                       faulty_agree)
    sync.ShardSync.receive = faulty_receive

    if "no_rebuild" in faults:
        from flwr_sharded.training import static_run

        static_run.rebuildable = lambda group=None: False

    if "step_delay" in faults:
        group, _, seconds = faults["step_delay"].rpartition(":")
        step = trainer.Trainer.step

        def slow_step(self):  # noqa: ANN001
            loss = step(self)
            if not group or self.topo.fed_index == int(group):
                time.sleep(float(seconds))
            return loss

        trainer.Trainer.step = slow_step

    if "commit_delay" in faults:
        phase = checkpoint.Checkpointer._phase

        def slow_phase(self, what, tmp, action):  # noqa: ANN001
            if what == "committing":
                time.sleep(float(faults["commit_delay"]))
            return phase(self, what, tmp, action)

        checkpoint.Checkpointer._phase = slow_phase

    if "exit_after_syncs" in faults:
        from flwr_sharded.flower.group import round as group_round

        period_end = group_round.GroupRound._period_end

        def exit_after(self, checksums):  # noqa: ANN001
            period_end(self, checksums)
            if self.rt.syncs >= int(faults["exit_after_syncs"]):
                import logging
                import sys

                logging.getLogger("flwr_sharded.group").error("injected fault: exiting after %d syncs", self.rt.syncs)
                sys.stderr.flush()
                os._exit(17)

        group_round.GroupRound._period_end = exit_after


if os.environ.get("FLWR_SHARDED_TEST_FAULTS") and "LOCAL_RANK" in os.environ:
    _install(dict(item.split("=", 1) for item in os.environ["FLWR_SHARDED_TEST_FAULTS"].split()))
