"""The static engine's run: `SyncLoop.run` until the run's last step over the static world's federation
(`StaticFederation`: the mesh's groups, fixed for the whole run), with the records around it (train windows,
evaluations and checkpoints at the run's ticks, failed syncs and their retries). A checkpoint that could not be
written stops the run on every rank (`CheckpointWriteError`)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from flwr_sharded.parallel.admission import behind
from flwr_sharded.errors import first_line
from flwr_sharded.parallel.collectives import CollectiveTimeout, bounded, group_timeout, rebuildable, wait_for
from flwr_sharded.parallel.sites import SiteLayout, site_groups
from flwr_sharded.parallel.sync import Groups
from flwr_sharded.parallel.token_weights import tokens_of
from flwr_sharded.parallel.topology import Topology
from flwr_sharded.parallel.torch_compat import all_gather_single
from flwr_sharded.run_dir import perplexity
from flwr_sharded.training.checkpoint import CheckpointWriteError
from flwr_sharded.training.checkpoint_series import latest_checkpoint
from flwr_sharded.training.federation import SyncFailed
from flwr_sharded.training.metrics import progress_bar, train_line
from flwr_sharded.training.sync_loop import SyncLoop

logger = logging.getLogger(__name__)

CONTROL_TIMEOUTS = 2
"""A member's control group has this many times the run's timeout: a rank that finished its part of a sync waits
there for the member's other ranks, one of which may still be inside its own shard's reduction, which times out
only one timeout after it began."""


class StaticFederation:
    """The static torchrun world's federation: the mesh's "fed" groups (or the channels of groups that shard
    differently). The group's ranks agree over a gloo group of their own: the group's process group also carries an
    async checkpoint's collectives, from its thread."""

    def __init__(self, topo: Topology, shapes: list[tuple[int, ...]], wait_timeout: float | None) -> None:
        self.topo, self.wait_timeout = topo, wait_timeout
        self.member_index, self.members = topo.fed_index, topo.config.federations
        self._groups = topo.sync_groups(shapes)  # a collective of the world: every rank makes every group
        sites = SiteLayout.parse(topo.config.sync_sites) if getattr(topo.config, "sync_sites", "") else None
        if sites is not None and sites.two_level:  # every shard index's site and share groups
            columns = [[topo.group_ranks(f)[i] for f in range(self.members)] for i in range(topo.group_world)]
            self._groups = site_groups(sites, columns, topo.group_rank, topo.fed_index, self._groups, topo.timeout)
        controls = [dist.new_group(topo.group_ranks(f), backend="gloo", timeout=CONTROL_TIMEOUTS * topo.timeout)
                    for f in range(self.members)]
        self.control = controls[topo.fed_index]
        """This member's ranks (the flags and errors of its syncs), with `CONTROL_TIMEOUTS` times the timeout."""
        self.leaders = topo.leaders or dist.new_group([topo.group_ranks(f)[0] for f in range(self.members)],
                                                      timeout=topo.timeout)
        """Rank 0 of every group (their times after each period)."""
        self.flat = topo.leaders is None and not (sites is not None and sites.two_level)
        """The groups shard alike and reduce in one level: `rebuild` can make their groups anew."""
        self._vote: dist.ProcessGroup | None = None
        """The rebuilt group of this rank's shard index (None: the mesh's)."""
        self._joined = False
        self._times: tuple[torch.Tensor, Any] | None = None
        """The members' times of the last period, exchanged with `now=False` and not returned yet."""

    def join(self) -> Groups:
        if self._joined:
            return None
        self._joined = True
        return self._groups

    def rebuild(self) -> None:
        """New process groups for the syncs, votes and the members' times after one of their collectives failed:
        gloo closes a group's connections when a collective on it times out, and every later collective on that
        group fails at once. Collective over the world (a member still stopped or late is waited for up to the
        run's timeout); SyncFailed when one does not come, or where the groups shard differently or reduce in two
        levels (groups the static engine does not make anew)."""
        topo = self.topo
        if not self.flat:
            raise SyncFailed("a collective of the sync failed, and the static engine makes the groups of members "
                             "that shard differently (--group-shards) or reduce in two levels (--sync-sites) only "
                             "once: stopping; continue with --resume from the last checkpoint")
        columns = [[topo.group_ranks(f)[i] for f in range(self.members)] for i in range(topo.group_world)]
        try:
            made = [dist.new_group(column, backend="gloo", timeout=topo.timeout) for column in columns]
        except Exception as exc:  # noqa: BLE001 - a member did not come within the timeout
            raise SyncFailed(f"the federation's groups could not be made anew after a failed collective: "
                             f"{first_line(exc)}; a member did not come back within --timeout "
                             f"{topo.timeout.total_seconds():g} s: stopping") from exc
        self._groups = self._vote = made[topo.group_rank]
        self.leaders = made[0]  # group rank 0 of every member
        self._joined, self._times = False, None

    def vote_group(self) -> dist.ProcessGroup | None:
        if self._vote is not None:
            return self._vote if self.topo.replica_index == 0 else None
        if self.topo.leaders is not None:  # groups that shard differently: their rank 0s vote for them
            return self.topo.leaders if self.topo.group_rank == 0 else None
        return self.topo.fed_group if self.topo.replica_index == 0 else None

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.topo.group_world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def flags(self, values: list[int]) -> list[int]:
        box = torch.tensor(values, dtype=torch.int32)
        bounded(dist.all_reduce, box, op=dist.ReduceOp.MAX, group=self.control)
        return box.tolist()

    def behind(self, adopted: int) -> list[int]:
        """Over the leaders (a group only the training thread uses: a sync may be in flight), then to every rank of
        the group."""
        box = torch.zeros(self.members, dtype=torch.float64, device=self._device)
        if self.topo.group_rank == 0:
            mine = torch.tensor([float(adopted)], dtype=torch.float64, device=self._device)
            bounded(all_gather_single, box, mine, group=self.leaders)
        bounded(dist.broadcast, box, group=self.topo.group_pg, group_src=0)
        return behind([int(n) for n in box.tolist()])

    def period_times(self, step_s: float, sync_s: float, steps: int, *, now: bool) -> dict[str, list[float]] | None:
        """Every group's times over the leaders, then to every rank of the group (two small collectives); `now=False`
        starts the leaders' exchange and returns the one started a period before."""
        box = torch.zeros(self.members * 3, dtype=torch.float64, device=self._device)
        work = None
        if self.topo.group_rank == 0:
            mine = torch.tensor([step_s, sync_s, float(steps)], dtype=torch.float64, device=self._device)
            work = all_gather_single(box, mine, group=self.leaders, async_op=True)
        if not now:
            self._times, started = (box, work), self._times
            return self._received_times(*started) if started is not None else None
        return self._received_times(box, work)

    def last_times(self) -> dict[str, list[float]] | None:
        started, self._times = self._times, None
        return self._received_times(*started) if started is not None else None

    def _received_times(self, box: torch.Tensor, work: Any) -> dict[str, list[float]]:
        if work is not None:
            wait_for(work, "the members' times", group_timeout(self.leaders, box.device))
        bounded(dist.broadcast, box, group=self.topo.group_pg, group_src=0)
        step_times, sync, counts = box.view(self.members, 3).T.tolist()
        return {"step_time_s": step_times, "sync_s": sync, "idle_s": [s - min(sync) for s in sync],
                "steps": [int(c) for c in counts]}

    @property
    def _device(self) -> torch.device:
        device = self.topo.mesh.device_type
        return torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


class StaticRun:
    """The static engine's records around `SyncLoop.run`: train windows, evaluations and checkpoints at the run's
    ticks, failed syncs and their retries, the progress bar. `run_dir`: the `RunDir` rank 0 writes (None
    elsewhere)."""

    def __init__(self, loop: SyncLoop, run_dir: Any) -> None:
        self.loop, self.t, self.run_dir = loop, loop.trainer, run_dir
        self.cfg = cfg = self.t.cfg
        self.bar = progress_bar(cfg.steps, enabled=self.t.is_logger and cfg.output.progress,
                                initial=self.t.step_count)
        self.started = self.window_start = time.perf_counter()
        self.loss_sum = torch.zeros((), device=self.t.device)
        self.window_steps, self.last, self.last_tick = 0, {}, self.t.step_count
        """The last tick seen: a resumed run's first records and checkpoint are the ones its schedule says, after the
        step it resumed from (not one at its first step)."""
        self.federation: StaticFederation | None = None
        """The federation's groups, made anew after a failed collective (`run` builds the first)."""

    def run(self) -> dict[str, Any]:
        """Train `steps` steps with syncs every A steps, logging and evaluating; returns the final metrics."""
        cfg, p, t = self.cfg, self.cfg.parallel, self.t
        federation = None
        if p.federated and p.sync:
            federation = StaticFederation(t.topo, [tuple(q.shape) for q in t.model.parameters()], cfg.timeout_s)
            self.federation = federation
            if p.sync_retries:
                self.loop.keep_rollback_point()
        try:
            self.loop.run(federation, until=cfg.steps, on_step=self.on_step, on_period=self.on_period,
                          on_failure=self.on_failure, confirm_at=self.records_due)
            if t.checkpointer is not None:
                self.checkpoint(t.checkpointer.wait)
        finally:
            self.bar.close()
        return self.last

    def stamp(self, record: dict[str, Any]) -> dict[str, Any]:
        p = self.cfg.parallel
        seen = (self.loop.tokens_trained if self.loop.adapt else  # each group its own steps
                tokens_of(self.cfg, steps=self.t.step_count, ranks=p.world_size))
        record.update(elapsed_s=time.perf_counter() - self.started, tokens_seen=seen)
        if self.run_dir is not None:
            self.run_dir.log(record)
        return record

    def on_step(self, loss: torch.Tensor, tick: int | None) -> None:
        """After a step (and its syncs): the window's loss, and at a tick the records due."""
        t = self.t
        self.loss_sum += loss
        self.window_steps += 1
        self.bar.update(1)
        if tick is None:
            return
        if self.due("log", tick):
            self.last = self.stamp(self.train_record(time.perf_counter() - self.window_start))
            self.show(self.last)
            self.loss_sum.zero_()
            self.window_start, self.window_steps = time.perf_counter(), 0
        if self.due("eval", tick):
            evaluated = time.perf_counter()
            self.last.update(self.stamp({"kind": "eval", "step": t.step_count, **t.evaluate()}))
            self.window_start += time.perf_counter() - evaluated  # evaluation is not training time
        if self.due("checkpoint", tick):
            self.checkpoint(self.loop.save_checkpoint)
        self.last_tick = tick

    def due(self, record: str, tick: int) -> bool:
        """Whether `record` ("log", "eval", "checkpoint") is due at `tick`: every so many ticks, and at the end."""
        if record == "checkpoint" and self.t.checkpointer is None:
            return False
        every = {"log": self.cfg.output.log_every, "eval": self.cfg.eval_every,
                 "checkpoint": self.cfg.checkpoint.every}[record]
        return bool(every and tick // every > self.last_tick // every) or tick >= self.cfg.steps

    def records_due(self, tick: int) -> bool:
        """Whether any record is due at `tick`: each takes every group (collectives over the world), so every member
        confirms the merges first and all are at the same tick (`SyncLoop.run`'s `confirm_at`)."""
        return any(self.due(record, tick) for record in ("log", "eval", "checkpoint"))

    def checkpoint(self, write: Callable[[], None]) -> None:
        """Run `write` (a save, or the pending async one's commit) on every rank of the world at the same tick; if it
        failed in any group, raise CheckpointWriteError on every rank: the run stops rather than train on without
        the checkpoint its user counts on (an async save's failure surfaces at the next save or at the end)."""
        error = ""
        try:
            write()
        except CheckpointWriteError as exc:
            error = f"federation group {self.t.topo.fed_index}: {exc}" if self.cfg.parallel.federations > 1 else \
                str(exc)
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)  # the default group: only this thread uses it
        failed = list(dict.fromkeys(e for e in errors if e))
        if not failed:  # committed by every group: only now may a series drop an older step
            self.t.checkpointer.prune()
            return
        checkpointer = self.t.checkpointer
        try:
            checkpointer.wait()  # an async save still in flight is committed before the run stops
        except CheckpointWriteError as exc:
            failed.append(str(exc))
        newest = latest_checkpoint(checkpointer.directory)
        raise CheckpointWriteError(f"{'; '.join(failed)}. The run stops at step {self.t.step_count} (newest "
                                   f"checkpoint: {newest.name if newest else 'none'}): resume it with --resume once "
                                   f"the checkpoint directory can be written")

    def on_period(self, times: dict[str, Any] | None) -> None:
        """The groups' step and sync times of a period (rank 0 logs them): this one's with `group-steps speed` (at
        this group's step count), else the one ending at its reference step (read a period later)."""
        if times is not None and self.run_dir is not None:
            step = self.t.step_count if self.loop.adapt else times["reference_step"]
            self.run_dir.log({"kind": "sync_groups", "step": step, **times})

    def on_failure(self, outcome: Any, failures: int, failed_at: int) -> None:
        """A sync failed at step `failed_at` and every rank is back at the last adopted one: its record, or
        `SyncFailed` once `sync-retries` failures in a row are spent."""
        retries, t = self.cfg.parallel.sync_retries, self.t
        where = f"the sync of fragment {outcome.fragment} after step {failed_at} failed: {outcome.error}"
        if failures > retries:
            raise SyncFailed(f"{where}; {failures} failed sync(s) in a row, --sync-retries {retries}: stopping")
        if outcome.collective_failed and not rebuildable():
            raise SyncFailed(f"{where}; a collective failed on NCCL, whose aborted communicators the static engine "
                             f"cannot rebuild (--sync-retries retries rejected results only): stopping; continue "
                             f"with --resume from the last checkpoint")
        if t.is_logger:
            logger.warning("%s; every rank is back at step %d (the last adopted sync), retry %d of %d "
                           "(--sync-retries)", where, t.step_count, failures, retries)
        self.stamp({"kind": "sync_failed", "step": failed_at, "restored_step": t.step_count,
                    "fragment": outcome.fragment, "error": outcome.error, "blame": outcome.blame, "retry": failures})
        self.last_tick = math.floor(self.loop.reference())  # its steps are logged again
        self.loss_sum.zero_()
        self.window_start, self.window_steps, self.bar.n = time.perf_counter(), 0, t.step_count
        if self.rebuild_needed(outcome.collective_failed):
            self.federation.rebuild()

    @staticmethod
    def rebuild_needed(collective_failed: bool) -> bool:
        """Whether a collective failed on any rank of the world (one small all-reduce over the world, which also
        waits, up to the run's timeout, for a member still stopped or late): then every rank rebuilds the
        federation's groups, together. False on NCCL, whose failed collectives stop the run instead."""
        if not rebuildable():
            return False
        flag = torch.tensor([int(collective_failed)], dtype=torch.int32)
        try:
            bounded(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=None)
        except CollectiveTimeout as exc:
            raise SyncFailed(f"after a failed sync, a member did not come back: {first_line(exc)}: stopping") from exc
        return bool(flag.item())

    def show(self, record: dict[str, Any]) -> None:
        """A train record on the progress bar, or in the log without one (rank 0)."""
        if self.t.is_logger and self.cfg.output.progress:
            self.bar.write(train_line(record, self.cfg.steps))
        elif self.t.is_logger:
            logger.info("%s", train_line(record, self.cfg.steps))
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def train_record(self, seconds: float) -> dict[str, Any]:
        """Training loss averaged over all ranks, throughput, memory and phase times of the window's steps."""
        cfg, t, steps = self.cfg, self.t, self.window_steps
        loss, peak_mib = t.window_stats(self.loss_sum, steps)
        phases = t.timer.collect()
        tokens_per_s = tokens_of(cfg, steps=steps, ranks=cfg.parallel.world_size) / max(seconds, 1e-9)
        return {"kind": "train", "step": t.step_count, "loss": loss, "ppl": perplexity(loss),
                "lr": t.scheduler.get_last_lr()[0], "tokens_per_s": tokens_per_s, "step_s": seconds / steps,
                "syncs": self.loop.report.syncs, "peak_memory_mib": peak_mib,
                **t.throughput.utilisation(tokens_per_s / cfg.parallel.world_size),
                **{f"{name}_s": value / steps for name, value in phases.items()}}
