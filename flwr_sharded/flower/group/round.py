"""One Flower round of a group: catch-up, K periods of A local steps, each step followed by the trainer's outer loop.

Per round the ServerApp names the members (ordered), member 0's rendezvous offer and a unique prefix. The round is
the outer loop's `Federation` (`RoundFederation`): replica 0 of each shard index joins, on the round's first sync,
the round's federation group of that index, and the group's ranks learn each other's outcome over the group's
control group. Everything else (the syncs, their two-phase commit, rollback) is the trainer's `OuterLoop`, the same
as in the static engine (`flwr_sharded.training.outer_loop`). A failed sync ends the round, every rank of every member
back at its last commit; the reply names the members held at fault. A group alone in a round still syncs (a no-op
for FedAvg, the outer step for outer optimizers).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from flwr_sharded.flower import rendezvous as rdv
from flwr_sharded.flower.group import channels
from flwr_sharded.flower.messages import TrainArgs
from flwr_sharded.parallel.sync_plan import Owners

logger = logging.getLogger("flwr_sharded.group")


class RoundFederation:
    """A round's members as the outer loop's federation: its rendezvous (once per round, replica 0 of each shard
    index; when the members shard differently, of each of its channels: `channels`) and the group's control group."""

    def __init__(self, runtime: Any, args: TrainArgs) -> None:
        self.rt, self.args = runtime, args
        self.member_index, self.members = args.member_index, len(args.members)
        self.wait_timeout: float | None = args.sync_timeout + 5.0
        self.groups: list[rdv.FederationGroup] = []
        self.channel_groups: dict[Owners, rdv.FederationGroup] = {}
        self.plan = channels.round_plan(args, channels.model_shapes(runtime.trainer.model))
        """The round's sync plan when its members shard differently; None: one group per shard index."""
        self.joined = False
        self.rendezvous_s = 0.0

    def join(self) -> None:
        if self.joined:
            return
        a, s, t = self.args, self.rt.topo.shard_index, self.rt.trainer
        start = time.perf_counter()
        backend = rdv.backend_for_device(t.device, self.rt.args.sync_backend)
        abort = self.rt.abort_check(a.prefix)
        if self.plan is not None:
            for owners, group in channels.join(a, self.plan, s, backend=backend, abort=abort):
                self.groups.append(group)
                self.channel_groups[owners] = group
            t.shard_sync.reseat(channels.seat_of(a, s), {k: g.pg for k, g in self.channel_groups.items()})
        else:
            group = rdv.join(host=a.rendezvous_host, port=a.rendezvous_ports[s], prefix=f"{a.prefix}/s{s}",
                             rank=a.member_index, size=len(a.members), rendezvous_timeout=a.rendezvous_timeout,
                             sync_timeout=a.sync_timeout, backend=backend, secret=a.secret, members=a.members,
                             abort=abort)
            self.groups.append(group)
            t.shard_sync.rebind(group.pg, None)
        self.joined = True
        self.rendezvous_s += time.perf_counter() - start

    def vote_group(self) -> Any:
        """Shard index s's group; when the members shard differently, the channel of shard 0 of every member (its
        other shards' outcome reaches it over the group's control group)."""
        if self.plan is not None:
            lead = self.channel_groups.get(channels.lead_channel(self.members))
            return lead.pg if lead is not None else None
        return self.groups[0].pg if self.groups else None

    def gather(self, obj: Any) -> list[Any]:
        return self.rt.gather(obj)

    def flags(self, values: list[int]) -> list[int]:
        box = torch.tensor(values, dtype=torch.int32)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.rt.ctrl)  # the group's gloo control group
        return box.tolist()

    def release(self, failed: bool) -> None:
        for g in self.groups:
            g.destroy(failed=failed)


class GroupRound:
    """One round of one group; `run()` executes it on every rank and returns rank 0's reply."""

    def __init__(self, runtime: Any, args: TrainArgs) -> None:
        self.rt = runtime
        self.t = runtime.trainer
        self.args = args
        self.topo = runtime.topo
        self.federation = RoundFederation(runtime, args)
        self.blame: set[int] = set()
        """Members this group holds at fault for a failed sync: absent at the rendezvous, or failed their part."""
        self.left_out: set[int] = set()
        """Members an adopted sync of this round left out (weight out of bounds, or values not finite)."""
        self.options = args.round.for_run(runtime.run)
        """This round's A, K, peak learning rate and FedProx mu: the strategy's, else the run's."""
        self.steps = args.local_steps(self.options.aggregate_every)
        """This member's local steps per sync: A, or its own (`member_steps`: the fastest member's is A)."""

    # ----- the round ------------------------------------------------------------------------------------------
    def run(self, *, apply_rule: bool = True) -> dict[str, Any]:
        """Train and sync; `apply_rule=False` stops each sync at the weighted mean (the server path's facility
        level, whose outer step runs after the server's mean arrives)."""
        a, t = self.args, self.t
        self._configure()
        losses: list[torch.Tensor] = []
        train_s = sync_s = 0.0
        syncs_done, failure, weight = 0, "", 0.0
        checksums: list[float] = []
        caught_up: list[float] = []
        try:
            if a.catch_up:  # a member (re)joined: everyone adopts member 0's state before training
                start = time.perf_counter()
                failure = self.catch_up()
                sync_s += time.perf_counter() - start
                if failure:
                    logger.warning("catch-up of round %s failed: %s", a.prefix, failure)
                else:
                    caught_up = self.rt.checksums()
            last = t.outer.schedule.fragments - 1
            for k in range(0 if failure else self.options.syncs_per_round):
                start = time.perf_counter()
                clock = t.schedule_step  # the run's reference step at the start of the period
                for step in range(1, self.steps + 1):
                    losses.append(t.step())
                    if self.steps != self.options.aggregate_every:  # the schedule on the fastest member's clock
                        t.follow_clock(clock + step * self.options.aggregate_every / self.steps)
                    self._progress(losses)
                    if not t.outer.due(step):
                        continue
                    if t.device.type == "cuda":
                        torch.cuda.synchronize()
                    train_s += time.perf_counter() - start
                    start = time.perf_counter()
                    for outcome in t.outer_step(step, self.federation, apply_rule=apply_rule):
                        self.blame.update(outcome.blame)
                        self.left_out.update(outcome.left_out)
                        failure = outcome.error
                        weight += outcome.weight if outcome.adopted and outcome.fragment == last else 0.0
                    sync_s += time.perf_counter() - start
                    start = time.perf_counter()
                    if failure:
                        break
                train_s += time.perf_counter() - start
                if failure:
                    logger.warning("sync %d of round %s failed, restored the last synced shards: %s", k + 1,
                                   a.prefix, failure)
                    break
                syncs_done += 1
                self.rt.syncs += 1
                checksums.extend(self.rt.checksums())  # after the period's last merge: every rank's shards
                if self.rt.args.debug_exit_after_syncs and self.rt.syncs >= self.rt.args.debug_exit_after_syncs:
                    logger.error("--debug-exit-after-syncs %d reached: exiting abruptly", self.rt.syncs)
                    os._exit(17)  # fault injection for tests: a crash between two syncs
        finally:
            if any(flight.in_flight for flight in t.shard_sync.flights):  # only if the round broke off mid-period
                t.outer.abandon()
            self.federation.release(failed=bool(failure))
        return self._result(losses, train_s, sync_s, syncs_done, failure, weight, checksums, caught_up)

    def _configure(self) -> None:
        """This round's peak learning rate and FedProx mu (the strategy's, else the run's)."""
        t, mu = self.t, float(self.options.proximal_mu)
        t.set_peak_lr(float(self.options.lr))
        if mu != t.proximal_mu:
            t.proximal_mu = mu
            t.set_anchor()  # the round starts at the last sync: its shards are w_sync

    def _progress(self, losses: list[torch.Tensor]) -> None:
        every = self.rt.run.train.output.log_every
        if self.rt.rank == 0 and len(losses) % every == 0:
            total = self.options.syncs_per_round * self.steps
            logger.info("round %d: step %d/%d of the round (run step %d), loss %.4f", self.args.server_round,
                        len(losses), total, self.t.step_count, float(losses[-1]))

    def _result(self, losses: list[torch.Tensor], train_s: float, sync_s: float, syncs: int, failure: str,
                weight: float, checksums: list[float], caught_up: list[float]) -> dict[str, Any]:
        t, cfg = self.t, self.t.cfg
        group_losses: list[float] = []
        if losses:
            stacked = torch.stack(losses).to(torch.float64)
            dist.all_reduce(stacked)
            group_losses = (stacked / self.rt.world).tolist()
        tokens = len(losses) * cfg.batch_size * cfg.grad_accum * cfg.data.seq_len * self.rt.world
        self.rt.tokens += tokens
        phases = t.timer.collect()  # frees the round's CUDA timing events
        p = cfg.parallel
        # groups end a period with equal shards unless a merge keeps local values (alpha, carry) or fragments differ
        equal = p.sync_fragments == 1 and p.sync_alpha == 0 and not p.carries
        comparable = {"checksums": checksums} if equal else {}
        return {"steps": len(losses), "losses": group_losses, "tokens": tokens, "total_tokens": self.rt.tokens,
                "train_s": train_s, "sync_s": sync_s, "rendezvous_s": self.federation.rendezvous_s, "syncs": syncs,
                "sync_failed": bool(failure), "sync_error": failure, **comparable, "step": t.step_count,
                "lr": t.scheduler.get_last_lr()[0], "members": len(self.args.members),
                "catch_up_checksums": caught_up, "sync_blame": sorted(self.blame),
                "sync_left_out": sorted(self.left_out), "facility_tokens": weight,
                "aggregate_every": self.options.aggregate_every, "local_steps": self.steps,
                "syncs_per_round": self.options.syncs_per_round, "peak_lr": t.scheduler.base_lrs[0],
                "proximal_mu": t.proximal_mu,
                **{f"{name}_s_total": value for name, value in phases.items()}}

    # ----- pieces ---------------------------------------------------------------------------------------------
    def catch_up(self) -> str:
        """A group (re)joined the run: every member adopts member 0's shards, outer state and clock (its schedule's
        step; with per-member steps, the run's reference step); returns '' or the error (then every rank is back at
        the last commit).

        Replica 0 of each shard index joins the round's federation group (or its channels, when the members shard
        differently) and receives member 0's shards and outer state by broadcast; the clock travels on shard index 0
        (the channel of every member's shard 0); FL+HSDP replicas then copy replica 0.
        """
        t, error, step = self.t, "", self.t.schedule_step
        if self.topo.replica_index == 0:
            try:
                self.federation.join()
                step = self._adopt_member_0()
            except Exception as exc:  # noqa: BLE001 - rendezvous, timeout, peer gone
                error = f"shard {self.topo.shard_index}: {rdv.first_line(exc)}"
        errors = [e for e in self.rt.gather(error) if e]
        if errors:
            t.outer.restore()
            return "; ".join(sorted(set(errors)))
        if self.topo.rep_group is not None:
            t.shard_sync.broadcast(self.topo.rep_group)
        step = self.rt.broadcast(step)  # rank 0 (replica 0, shard 0) knows member 0's clock
        if (step, step) != (t.step_count, t.schedule_step):
            logger.info("caught up: step %d -> %d (member 0's clock)", t.step_count, step)
            t.set_step(step)
        t.set_anchor()
        t.outer.commit()
        return ""

    def _adopt_member_0(self) -> int:
        """Replica 0: member 0's shards and outer state, over this shard index's group, or piece by piece over each
        channel when the members shard differently; returns member 0's clock (where this rank learns it)."""
        t = self.t
        pg = self.federation.vote_group()
        over = pg if self.federation.plan is None else None  # None: over each bucket's channel
        t.shard_sync.broadcast(over, source=0)
        t.shard_sync.broadcast_outer_state(over, source=0)
        if pg is None:
            return t.schedule_step
        box = torch.tensor([t.schedule_step], dtype=torch.int64, device=t.device)
        dist.broadcast(box, group=pg, group_src=0)
        return int(box.item())
