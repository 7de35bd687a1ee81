"""One Flower round of a group, owned by one object: catch-up, K periods of A local steps, the syncs, commit and
rollback.

Per round the ServerApp names the members (ordered), member 0's rendezvous offer and a unique prefix. Replica 0 of
each shard index joins, on the round's first sync, the round's federation group of that index and runs the
trainer's `ShardSync` over it; FL+HSDP replicas then receive the result by broadcast, but only once every rank of the
group knows that every shard index succeeded. A sync is adopted by a two-phase commit: only when every member's every
rank succeeded (`commit_vote`); then it is committed (`RollbackPoint`). A sync that fails on any rank of any member
restores the last commit on every rank of every member (shards, optimizer, outer state, step and schedule), and the
round ends there; the reply names the members held at fault. A group alone in a round still syncs (a
no-op for FedAvg, the outer step for outer optimizers).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from flwr_sharded.flower import rendezvous as rdv
from flwr_sharded.flower.messages import TrainArgs
from flwr_sharded.parallel.admission import commit_vote
from flwr_sharded.parallel.sync import local_shard

logger = logging.getLogger("flwr_sharded.group")


class GroupRound:
    """One round of one group; `run()` executes it on every rank and returns rank 0's reply."""

    def __init__(self, runtime: Any, args: TrainArgs) -> None:
        self.rt = runtime
        self.t = runtime.trainer
        self.args = args
        self.topo = runtime.topo
        self.groups: list[rdv.FederationGroup] = []
        self.start_errors: dict[int, tuple[str, list[int]]] = {}
        """Fragments whose overlapped sync failed to start on this rank: why, and the members it holds at fault."""
        self.blame: set[int] = set()
        """Members this group holds at fault for a failed sync: absent at the rendezvous, or failed their part."""
        self.left_out: set[int] = set()
        """Members an adopted sync of this round left out (weight out of bounds, or values not finite)."""
        self.rendezvous_s = 0.0
        run = runtime.run
        self.periods = int(args.overrides.get("syncs-per-round", run.federation.syncs_per_round))
        self.steps = int(args.overrides.get("aggregate-every", run.train.parallel.aggregate_every))

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
            schedule = t.shard_sync.schedule
            for k in range(0 if failure else self.periods):
                start = time.perf_counter()
                for step in range(1, self.steps + 1):
                    losses.append(t.step())
                    self._progress(losses)
                    merges, starts = schedule.merges(step), schedule.starts(step)
                    if not merges and not starts:
                        continue
                    if t.device.type == "cuda":
                        torch.cuda.synchronize()
                    train_s += time.perf_counter() - start
                    start = time.perf_counter()
                    for i in merges:
                        failure, fragment_weight = self.sync(i, apply_rule)
                        if failure:
                            break
                        weight += fragment_weight if i == schedule.fragments - 1 else 0.0  # once per period
                    for i in ([] if failure else starts):
                        self.start(i)
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
                t.shard_sync.abandon()
            for g in self.groups:
                g.destroy(failed=bool(failure))
        return self._result(losses, train_s, sync_s, syncs_done, failure, weight, checksums, caught_up)

    def _configure(self) -> None:
        """This round's options: the strategy's overrides, else the run's values."""
        t, cfg = self.t, self.rt.run.train
        t.set_peak_lr(float(self.args.overrides.get("lr", cfg.optim.lr)))
        mu = float(self.args.overrides.get("proximal-mu", cfg.optim.proximal_mu))
        if mu != t.proximal_mu:
            t.proximal_mu = mu
            t.set_anchor()  # the round starts at the last sync: its shards are w_sync

    def _progress(self, losses: list[torch.Tensor]) -> None:
        every = self.rt.run.train.output.log_every
        if self.rt.rank == 0 and len(losses) % every == 0:
            total = self.periods * self.steps
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
        comparable = {"checksums": checksums} if p.sync_fragments == 1 and p.sync_alpha == 0 else {}
        return {"steps": len(losses), "losses": group_losses, "tokens": tokens, "total_tokens": self.rt.tokens,
                "train_s": train_s, "sync_s": sync_s, "rendezvous_s": self.rendezvous_s, "syncs": syncs,
                "sync_failed": bool(failure), "sync_error": failure, **comparable, "step": t.step_count,
                "lr": t.scheduler.get_last_lr()[0], "members": len(self.args.members),
                "catch_up_checksums": caught_up, "sync_blame": sorted(self.blame),
                "sync_left_out": sorted(self.left_out), "facility_tokens": weight, "aggregate_every": self.steps,
                "syncs_per_round": self.periods, "peak_lr": t.scheduler.base_lrs[0], "proximal_mu": t.proximal_mu,
                **{f"{name}_s_total": value for name, value in phases.items()}}

    # ----- pieces ---------------------------------------------------------------------------------------------
    def join(self) -> None:
        """Replica 0: form the round's federation group of this rank's shard index (once per round)."""
        if self.groups:
            return
        a, s = self.args, self.topo.shard_index
        start = time.perf_counter()
        backend = rdv.backend_for_device(self.t.device, self.rt.args.sync_backend)
        group = rdv.join(host=a.rendezvous_host, port=a.rendezvous_ports[s], prefix=f"{a.prefix}/s{s}",
                         rank=a.member_index, size=len(a.members), rendezvous_timeout=a.rendezvous_timeout,
                         sync_timeout=a.sync_timeout, backend=backend, secret=a.secret, members=a.members,
                         abort=self.rt.abort_check(a.prefix))
        self.groups.append(group)
        self.t.shard_sync.rebind(group.pg, None)
        self.rendezvous_s += time.perf_counter() - start

    def start(self, i: int) -> None:
        """Replica 0: begin fragment i's overlapped sync (joining the round's federation group first); an error is
        kept for the merge, where every rank learns it. Replicas > 0 only restart the fragment's token count."""
        if self.topo.replica_index != 0:
            self.t.take_weight(i)
            return
        try:
            self.join()
            self.t.start_sync(i)
        except Exception as exc:  # noqa: BLE001 - rendezvous, peer gone, misaligned shards
            self.start_errors[i] = (f"shard {self.topo.shard_index}: {rdv.first_line(exc)}",
                                    list(getattr(exc, "missing", [])))

    def sync(self, i: int, apply_rule: bool) -> tuple[str, float]:
        """Fragment i's shard sync with the round's members (blocking, or the merge of the overlapped one started
        `sync-delay` steps ago), adopted by a two-phase commit: ('' or the error, the members' total weight as
        replica 0 knows it). On failure every rank of every member is back at the last commit of every fragment,
        and no sync is left in flight.

        Phase one: replica 0 of each shard index runs its part; the group's ranks learn each other's outcome.
        Phase two: each of them tells the members of its federation group whether the whole group succeeded
        (`commit_vote`); the sync is adopted only if every member did. A rank whose own collective failed does not
        vote (its peers' vote then fails too, within the sync timeout, or at once when its group is released)."""
        t, weight, reached = self.t, 0.0, False
        error, blame = self.start_errors.pop(i, ("", []))
        self.rt.sync_attempts += 1
        if self.rt.rank == 0 and self.rt.sync_attempts == self.rt.args.debug_nan_sync:
            self._poison()
        if self.topo.replica_index == 0 and not error:
            try:
                self.join()
                # token-weighted FedAvg (or outer rule); an overlapped sync's wait is bounded by the sync timeout
                weight = t.complete_sync(i, apply_rule=apply_rule, timeout=self.args.sync_timeout + 5.0).total_weight
                reached = True
                if self.rt.rank == 0 and self.rt.sync_attempts == self.rt.args.debug_fail_sync:
                    error = f"--debug-fail-sync {self.rt.args.debug_fail_sync}: failed after the reduction"
            except Exception as exc:  # noqa: BLE001 - rendezvous, timeout, peer gone, misaligned shards
                error = f"shard {self.topo.shard_index}: {rdv.first_line(exc)}"
                blame = list(getattr(exc, "missing", []))
        elif self.topo.replica_index != 0 and t.shard_sync.schedule.delay == 0:
            t.take_weight(i)  # a replica > 0 receives the result by broadcast below
        phase_one = self.rt.gather((error, blame))
        errors = sorted({e for e, _ in phase_one if e})
        vote_error, noes = "", []
        if reached:
            try:
                noes = commit_vote(not errors, self.groups[0].pg, t.device)
            except Exception as exc:  # noqa: BLE001 - a member gone between the phases
                vote_error = f"shard {self.topo.shard_index}: commit vote: {rdv.first_line(exc)}"
        left_out = t.shard_sync.fragments[i].left_out if reached else []
        phase_two = self.rt.gather((vote_error, noes, left_out))
        noes = sorted({j for _, js, _ in phase_two for j in js})
        self.blame.update(j for _, js in phase_one for j in js)
        self.blame.update(noes)
        errors += sorted({e for e, _, _ in phase_two if e})
        if noes and not errors:
            errors.append(f"member(s) {noes} did not complete the sync: no member adopts it")
        if errors:
            t.abandon_syncs()
            self.rt.rollback.restore()
            return "; ".join(errors), weight
        if self.topo.rep_group is not None:
            t.shard_sync.fragments[i].broadcast(self.topo.rep_group)
        t.after_sync(i)
        excluded = sorted({j for _, _, js in phase_two for j in js})
        self.left_out.update(excluded)
        if self.args.member_index in excluded:  # healed by the others' mean; its moments may hold the same NaN
            self.rt.rollback.restore_optimizer(i)
        self.rt.rollback.commit(i)
        return "", weight

    @torch.no_grad()
    def _poison(self) -> None:
        """Fault injection for tests (`--debug-nan-sync`): a diverged rank, NaN in a shard and in its moments."""
        logger.error("--debug-nan-sync %d: NaN in this rank's first shard and its optimizer state",
                     self.rt.sync_attempts)
        param = next(iter(self.t.model.parameters()))
        local_shard(param).view(-1)[0] = float("nan")
        for value in self.t.optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local_shard(value).fill_(float("nan"))

    def catch_up(self) -> str:
        """Every member adopts member 0's shards, outer state and schedule position (a group (re)joined the run);
        returns '' or the error (then every rank is back at the last commit).

        Replica 0 of each shard index joins the round's federation group and receives member 0's shards and outer
        state by broadcast; the step count travels on shard index 0; FL+HSDP replicas then copy replica 0.
        """
        t, error, step = self.t, "", self.t.step_count
        if self.topo.replica_index == 0:
            try:
                self.join()
                pg = self.groups[0].pg
                t.shard_sync.broadcast(pg)
                t.shard_sync.broadcast_outer_state(pg)
                box = torch.tensor([t.step_count], dtype=torch.int64, device=t.device)
                dist.broadcast(box, group=pg, group_src=0)
                step = int(box.item())
            except Exception as exc:  # noqa: BLE001 - rendezvous, timeout, peer gone
                error = f"shard {self.topo.shard_index}: {rdv.first_line(exc)}"
        errors = [e for e in self.rt.gather(error) if e]
        if errors:
            self.rt.rollback.restore()
            return "; ".join(sorted(set(errors)))
        if self.topo.rep_group is not None:
            t.shard_sync.broadcast(self.topo.rep_group)
        step = self.rt.broadcast(step)  # rank 0 (replica 0, shard 0) knows member 0's step count
        if step != t.step_count:
            logger.info("caught up: step %d -> %d (member 0's)", t.step_count, step)
            t.step_count = step
            t.scheduler.last_epoch = step - 1
            t.scheduler.step()  # the learning rate of step `step`
        t.set_anchor()
        self.rt.rollback.commit()
        return ""
