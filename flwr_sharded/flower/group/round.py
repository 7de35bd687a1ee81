"""One Flower round of a group: catch-up, then K periods of `SyncLoop.run` over the round's members.

Per round the ServerApp names the members (ordered), member 0's rendezvous offer and a unique prefix. The round is
the loop's `Federation` (`RoundFederation`): replica 0 of each shard index joins, on the round's first sync, the
round's federation group of that index (or its channels, when the members shard differently), and the group's ranks
learn each other's outcome over the group's control group. A failed sync ends the round, every rank of every member
back at its last commit; the reply names the members held at fault. A group alone in a round still syncs (a no-op
for FedAvg, the outer step for outer optimizers).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from flwr_sharded.flower import rendezvous
from flwr_sharded.flower.group import aborts, channels
from flwr_sharded.flower.group.contract import RoundRuntime
from flwr_sharded.flower.group.round_context import RoundContext
from flwr_sharded.parallel.admission import confirm
from flwr_sharded.parallel.collectives import bounded
from flwr_sharded.parallel.sites import SiteLayout
from flwr_sharded.parallel.token_weights import tokens_of
from flwr_sharded.parallel.sync import Groups
from flwr_sharded.parallel.sync_plan import Owners
from flwr_sharded.training.catch_up import catch_up
from flwr_sharded.training.federation import RunReport

logger = logging.getLogger("flwr_sharded.group")


class RoundFederation:
    """A round's members as the loop's federation: its rendezvous (once per round, replica 0 of each shard index;
    when the members shard differently, of each of its channels: `channels`) and the group's control group."""

    def __init__(self, runtime: RoundRuntime, ctx: RoundContext) -> None:
        self.rt, self.ctx = runtime, ctx
        self.member_index, self.members = ctx.member_index, len(ctx.members)
        self.wait_timeout: float | None = ctx.args.sync_timeout + 5.0
        self.groups: list[rendezvous.FederationGroup] = []
        self.channel_groups: dict[Owners, rendezvous.FederationGroup] = {}
        self.joined = False
        self.rendezvous_s = 0.0
        self.two_level = False
        """This rank joined site groups (the round reduces in two levels: `flwr_sharded.parallel.sites`)."""

    def join(self) -> Groups:
        if self.joined:
            return None
        a, s, t = self.ctx.args, self.ctx.shard, self.rt.loop.trainer
        start = time.perf_counter()
        backend = rendezvous.backend_for_device(t.device, self.rt.args.sync_backend)
        abort = aborts.abort_check(a.prefix)
        if self.ctx.plan is not None:
            for owners, group in channels.join_channels(self.ctx, backend=backend, abort=abort):
                self.groups.append(group)
                self.channel_groups[owners] = group
            joined: Groups = {k: g.pg for k, g in self.channel_groups.items()}
        else:
            group = rendezvous.join(host=a.rendezvous_host, port=a.rendezvous_ports[s], prefix=f"{a.prefix}/s{s}",
                             rank=a.member_index, size=len(a.members), rendezvous_timeout=a.rendezvous_timeout,
                             sync_timeout=a.sync_timeout, backend=backend, secret=a.secret, members=a.members,
                             abort=abort)
            self.groups.append(group)
            joined = group.pg
            if a.member_sites:  # the round reduces in two levels: this member's site and share groups
                joined, made = rendezvous.store_site_groups(group, SiteLayout(tuple(a.member_sites)), a.sync_timeout,
                                                      t.device if backend == "nccl" else None)
                self.groups.extend(made)
                self.two_level = True
        self.joined = True
        self.rendezvous_s += time.perf_counter() - start
        return joined

    def vote_group(self) -> Any:
        """Shard index s's group; when the members shard differently, the channel of shard 0 of every member (its
        other shards' outcome reaches it over the group's control group)."""
        if self.ctx.plan is not None:
            lead = self.channel_groups.get(channels.lead_channel(self.members))
            return lead.pg if lead is not None else None
        return self.groups[0].pg if self.groups else None

    def gather(self, obj: Any) -> list[Any]:
        return self.rt.gather(obj)

    def behind(self, adopted: int) -> list[int]:
        """Over the vote group (at the round's end: no sync is in flight on it); [] where this rank has none."""
        group = self.vote_group()
        return confirm(adopted, group, self.rt.loop.trainer.device) if group is not None else []

    def flags(self, values: list[int]) -> list[int]:
        box = torch.tensor(values, dtype=torch.int32)
        bounded(dist.all_reduce, box, op=dist.ReduceOp.MAX, group=self.rt.ctrl)  # the group's gloo control group
        return box.tolist()

    def period_times(self, step_s: float, sync_s: float, steps: int, *, now: bool) -> None:
        return None  # the strategy times the members from their replies

    def last_times(self) -> None:
        return None

    def release(self, failed: bool) -> None:
        for g in self.groups:
            g.destroy(failed=failed)


class GroupRound:
    """One round of one group; `run()` executes it on every rank and returns rank 0's reply."""

    def __init__(self, runtime: RoundRuntime, ctx: RoundContext) -> None:
        self.rt, self.ctx = runtime, ctx
        self.loop = runtime.loop
        self.federation = RoundFederation(runtime, ctx)

    def run(self, *, apply_rule: bool = True) -> dict[str, Any]:
        """Train and sync; `apply_rule=False` stops each sync at the weighted mean (the server path's facility
        level, whose outer step runs after the server's mean arrives)."""
        a, loop = self.ctx.args, self.loop
        losses: list[torch.Tensor] = []
        checksums: list[float] = []
        caught_up: list[float] = []
        report, failure, catch_up_s = RunReport(), "", 0.0
        try:
            if a.catch_up:  # a member (re)joined: everyone adopts member 0's state before training
                start = time.perf_counter()
                failure = catch_up(loop, self.federation)
                catch_up_s = time.perf_counter() - start
                if failure:
                    logger.warning("catch-up of round %s failed: %s", a.prefix, failure)
                else:
                    caught_up = self.rt.checksums()
            if not failure:
                report = loop.run(self.federation, periods=self.ctx.options.syncs_per_round,
                                  on_step=lambda loss, _: self._progress(losses, loss),
                                  on_period=lambda _: self._period_end(checksums), apply_rule=apply_rule)
                failure = report.error
                if failure:
                    logger.warning("sync %d of round %s failed, restored the last synced shards: %s",
                                   report.periods + 1, a.prefix, failure)
        finally:
            self.federation.release(failed=bool(failure))
        return self._result(losses, report, catch_up_s, failure, checksums, caught_up)

    def _period_end(self, checksums: list[float]) -> None:
        """A period's syncs were adopted: every rank's shard checksums."""
        self.rt.syncs += 1
        checksums.extend(self.rt.checksums())

    def _progress(self, losses: list[torch.Tensor], loss: torch.Tensor) -> None:
        losses.append(loss)
        every = self.rt.run.train.output.log_every
        if self.rt.rank == 0 and len(losses) % every == 0:
            total = self.ctx.options.syncs_per_round * self.ctx.steps
            logger.info("round %d: step %d/%d of the round (run step %d), loss %.4f", self.ctx.args.server_round,
                        len(losses), total, self.loop.trainer.step_count, float(loss))

    def _result(self, losses: list[torch.Tensor], report: RunReport, catch_up_s: float, failure: str,
                checksums: list[float], caught_up: list[float]) -> dict[str, Any]:
        t = self.loop.trainer
        group_losses: list[float] = []
        if losses:
            stacked = torch.stack(losses).to(torch.float64)
            dist.all_reduce(stacked)
            group_losses = (stacked / self.rt.world).tolist()
        sent = torch.tensor([report.sync_bytes], dtype=torch.int64)
        dist.all_reduce(sent)  # every rank sends its own shard's bytes: the group's total
        tokens = tokens_of(t.cfg, steps=len(losses), ranks=self.rt.world)
        self.rt.tokens += tokens
        phases = t.timer.collect()  # frees the round's CUDA timing events
        p = t.cfg.parallel
        # groups end a period with equal shards unless a merge keeps local values (alpha, carry) or fragments differ
        equal = p.sync_fragments == 1 and p.sync_alpha == 0 and not p.carries
        return {"steps": len(losses), "losses": group_losses, "tokens": tokens, "total_tokens": self.rt.tokens,
                "train_s": report.train_s, "sync_s": catch_up_s + report.sync_s,
                "rendezvous_s": self.federation.rendezvous_s, "syncs": report.periods, "sync_bytes": int(sent),
                "sync_failed": bool(failure), "two_level": self.federation.two_level,
                "sync_error": failure, **({"checksums": checksums} if equal else {}), "step": t.step_count,
                "lr": t.scheduler.get_last_lr()[0], "members": len(self.ctx.members),
                "catch_up_checksums": caught_up, "sync_blame": sorted(report.blame),
                "sync_left_out": sorted(report.left_out), "facility_tokens": report.weight,
                "aggregate_every": self.ctx.options.aggregate_every, "local_steps": self.ctx.steps,
                "syncs_per_round": self.ctx.options.syncs_per_round, "peak_lr": t.scheduler.base_lrs[0],
                "proximal_mu": t.proximal_mu, **{f"{name}_s_total": value for name, value in phases.items()}}
