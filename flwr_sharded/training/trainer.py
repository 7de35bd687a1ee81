"""What one rank does: build the sharded model, run local steps, sync shards every A steps, evaluate, log.

The same `Trainer` runs inside the static torchrun world (`flwr_sharded.train`, loop in `run`) and inside a Flower
group, whose round object (`flwr_sharded.flower.group.round`) drives `step` itself. Both hand the shard sync to the
trainer's `OuterLoop` (`flwr_sharded.training.outer_loop`) after every step, with their own `Federation`.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flwr_sharded.config import TrainConfig, config_to_dict
from flwr_sharded.validation import outer_rule
from flwr_sharded.parallel.contribution import expected_weight_of
from flwr_sharded.parallel.schedule import Schedule
from flwr_sharded.parallel.sharding import mixed_precision_policy
from flwr_sharded.parallel.streaming import FragmentedSync, fragment_parameters
from flwr_sharded.parallel.sync import ShardSync, local_shard
from flwr_sharded.parallel.topology import Topology
from flwr_sharded.parallel.wire import WIRES
from flwr_sharded.run_dir import perplexity
from flwr_sharded.training import data as data_lib
from flwr_sharded.training.partition import BatchStream, eval_batches
from flwr_sharded.training.checkpoint import CheckpointWriteError, Checkpointer, check_compatible, resumed_line, \
    schedule_span
from flwr_sharded.training.metrics import PhaseTimer, Throughput
from flwr_sharded.training.model_init import build_sharded_model
from flwr_sharded.training.models import transformer_blocks
from flwr_sharded.training.outer_loop import OuterLoop, StaticFederation, SyncFailed, SyncOutcome
from flwr_sharded.training.pace import Pace
from flwr_sharded.training.proximal import ProximalTerm
from flwr_sharded.training.hf_checkpoint import save_sharded_pretrained

logger = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


def lr_lambda(cfg: TrainConfig, steps: int | None = None):
    """Linear warm-up to the peak, then cosine decay to `min_lr_ratio` of it at `steps` (default: the run's), flat
    after it."""
    o, steps = cfg.optim, steps or cfg.steps
    warmup = int(o.warmup * steps) if o.warmup < 1 else int(o.warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def effective_batch(cfg: TrainConfig) -> int:
    """Sequences behind one optimizer step of one model: the whole world for fsdp/hsdp, one group for FL."""
    p = cfg.parallel
    ranks = p.replicas * p.shards if p.federated else p.world_size
    return ranks * cfg.batch_size * cfg.grad_accum


class Trainer:
    """One rank of a (F, R, S) run: the sharded model, its optimizer and data, and the shard sync."""

    def __init__(self, cfg: TrainConfig, topo: Topology, *, static_sync: bool = True,
                 partition: tuple[int, int] | None = None) -> None:
        """Build this rank's part of the run.

        Args:
            static_sync: sync over the mesh's "fed" dimension (the static torchrun world). A Flower group passes
                False and installs per-round groups with `ShardSync.rebind`.
            partition: (federation index, number of federations) for data partitioning when the mesh does not hold
                the federation dimension (a Flower group is one federation group of a larger run).
        """
        self.cfg, self.topo = cfg, topo
        self.device = torch.device(topo.mesh.device_type, torch.cuda.current_device()) \
            if topo.mesh.device_type == "cuda" else torch.device("cpu")
        self.is_logger = dist.get_rank() == 0
        self.tokenizer = data_lib.load_tokenizer(cfg.data, cfg.model.name)  # a hub/local model's own by default
        self.blocks = data_lib.load_blocks(cfg.data, self.tokenizer)

        torch.manual_seed(cfg.seed)
        # built on the meta device, sharded, then only this rank's rows initialised (a function of the seed alone:
        # the same full weights in every group and for any S) or read from the pretrained checkpoint
        self.model = build_sharded_model(
            cfg.model.name, vocab_size=self.blocks.vocab_size, max_seq_len=cfg.data.seq_len, mesh=topo.fsdp_mesh,
            seed=cfg.seed, mp_policy=mixed_precision_policy(cfg.model.precision, topo.mesh.device_type),
            device=self.device, pretrained=cfg.model.pretrained, reshard_after_forward=cfg.model.reshard_after_forward,
            activation_checkpointing=cfg.model.activation_checkpointing)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.schedule_steps = cfg.steps
        """The steps the schedule spans: the run's, or a resumed checkpoint's (`checkpoint.schedule_span`)."""
        self.resumed_from: tuple[int, Path] | None = None
        """(step, checkpoint) once `resume` ran."""

        p = cfg.parallel
        fed_index, num_feds = partition or (topo.fed_index, p.federations)
        dp_index, dp_world = ((topo.dp_index, sum(topo.group_worlds)) if partition is None else
                              (fed_index * topo.group_world + topo.group_rank, num_feds * topo.group_world))
        self.stream = BatchStream(self.blocks, batch_size=cfg.batch_size, fed_index=fed_index, num_feds=num_feds,
                                  dp_index=dp_index, dp_world=dp_world, seed=cfg.seed, partition=cfg.data.partition,
                                  group=(topo.group_rank, topo.group_world))
        n_eval = (min(cfg.data.eval_blocks, len(self.blocks.validation)) // topo.group_world) * topo.group_world
        self.eval_data = eval_batches(self.blocks, batch_size=cfg.batch_size, group_rank=topo.group_rank,
                                               group_world=topo.group_world, max_blocks=n_eval)
        self.outer: OuterLoop | None = None
        """The outer loop over the shard sync (FL methods)."""
        if p.federated:
            replica0 = topo.replica_index == 0
            parts = fragment_parameters(self.model, transformer_blocks(self.model), p.sync_fragments)
            # every rank makes the channels' groups of groups that shard differently (a collective of the world)
            groups = topo.sync_groups([tuple(q.shape) for q in self.model.parameters()]) if static_sync else None
            syncs = [ShardSync(part, fed_group=groups if replica0 else None,
                               bucket_bytes=int(p.bucket_mb * (1 << 20)), rule=outer_rule(p),
                               wire_dtype=WIRES[p.sync_dtype].torch_dtype(), error_feedback=p.sync_error_feedback,
                               max_move=p.sync_max_move, topk=p.sync_topk, seat=topo.seat)
                     for part in parts]
            sync = FragmentedSync(syncs, Schedule(p.aggregate_every, p.sync_fragments, p.sync_delay),
                                  carry=p.carries)
            self._fragment_of = {id(param): i for i, part in enumerate(parts) for _, param in part}
            self.outer = OuterLoop(self, sync, topo, alpha=p.sync_alpha, reset_optimizer_state=p.reset_optimizer_state,
                                   max_weight=lambda steps: expected_weight_of(cfg, steps=steps,
                                                                               worlds=[max(topo.group_worlds)]))
            if p.group_steps == "speed":  # a faster group brings up to A steps' tokens, whatever this group's steps
                self.outer.most_steps = p.aggregate_every
        self.step_delay = 0.0
        """Seconds this rank sleeps after each inner step (a slower group, for tests and benchmarks)."""
        self.proximal_mu = cfg.optim.proximal_mu
        """FedProx's mu of the current round (0: off)."""
        self.proximal = ProximalTerm(self.model)
        self.timer = PhaseTimer(topo.mesh.device_type)
        self.step_count = 0
        self.checkpointer = None
        if cfg.checkpoint.dir:
            self.checkpointer = Checkpointer(cfg.checkpoint.dir, fed_index=fed_index, group_rank=topo.group_rank,
                                             group_pg=topo.group_pg, keep=cfg.checkpoint.keep,
                                             async_save=cfg.checkpoint.async_save)
        self.throughput = Throughput(self.model, cfg, self.device)

    # ----- building blocks ------------------------------------------------------------------------------------
    def step(self) -> torch.Tensor:
        """One optimizer step (with gradient accumulation and clipping); returns the mean loss as a tensor."""
        cfg = self.cfg
        self.model.train()
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            batch = next(self.stream).to(self.device, non_blocking=True)
            self.model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
            with self.timer.phase("forward"):
                loss = self.model(input_ids=batch, labels=batch).loss / cfg.grad_accum
            with self.timer.phase("backward"):
                loss.backward()
            total += loss.detach()
            if self.outer is not None:
                self.outer.count(batch.numel())
        with self.timer.phase("optimizer"):
            if self.proximal_mu > 0:
                self.proximal.add_gradient(self.proximal_mu)
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        return total

    def set_anchor(self, fragment: int | None = None) -> None:
        """FedProx: the current shards (of one fragment, or all) become w_sync when mu > 0; otherwise the anchor's
        memory is freed."""
        if self.proximal_mu > 0:
            self.proximal.set_anchor(None if fragment is None else self.fragment_params(fragment))
        else:
            self.proximal.release()

    def fragment_params(self, i: int) -> list[nn.Parameter]:
        """The parameters of sync fragment i."""
        return [param for param in self.model.parameters() if self._fragment_of[id(param)] == i]

    def set_peak_lr(self, lr: float) -> None:
        """Make `lr` the schedule's peak from the next step on (the schedule's shape is kept)."""
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["lr"] = lr * factor(self.scheduler.last_epoch)

    @property
    def shard_sync(self) -> FragmentedSync | None:
        """The outer loop's fragmented shard sync (FL methods)."""
        return self.outer.sync if self.outer is not None else None

    # ----- the clock: step and learning-rate schedule -----------------------------------------------------------
    def clock(self) -> dict[str, Any]:
        """The step count and the learning-rate schedule's state (what a rollback or a resume puts back)."""
        return {"step": self.step_count, "scheduler": self.scheduler.state_dict()}

    def set_clock(self, state: dict[str, Any]) -> None:
        """Put back a `clock()`: the step count, the schedule, and the optimizer's learning rate of that step."""
        self.step_count = state["step"]
        self.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

    @property
    def schedule_step(self) -> int:
        """The learning-rate schedule's step: the step count, or with per-group steps the run's reference step."""
        return int(self.scheduler.last_epoch)

    def set_step(self, step: int) -> None:
        """Continue from step `step` with the schedule's learning rate of that step (a catch-up to another member)."""
        self.step_count = step
        self.scheduler.last_epoch = step - 1
        self.scheduler.step()  # the learning rate of step `step`

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss and perplexity, averaged over every rank's slice (and over groups)."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in self.eval_data:
            batch = batch.to(self.device)
            loss = self.model(input_ids=batch, labels=batch).loss
            predicted = batch.shape[0] * (batch.shape[1] - 1)
            sums += torch.tensor([loss.item() * predicted, predicted], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        mean = float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
        return {"eval_loss": mean, "eval_ppl": perplexity(mean)}

    def save_checkpoint(self, extra_meta: dict[str, Any] | None = None) -> None:
        """Checkpoint this group at the current step (collective over the group)."""
        if self.checkpointer is None:
            raise RuntimeError("no --checkpoint-dir configured")
        meta = {"config": config_to_dict(self.cfg), "vocab_size": self.blocks.vocab_size,
                "scheduler": self.scheduler.state_dict(), "schedule_steps": self.schedule_steps,
                **(extra_meta or {})}
        rank_state = {"stream": self.stream.state(), "rng": torch.get_rng_state(),
                      "fragment_tokens": list(self.outer.tokens) if self.outer is not None else [0]}
        if self.shard_sync is not None and self.shard_sync.keeps_global:
            rank_state["outer"] = self.shard_sync.outer_state_dict()  # sharded like the parameters
        if self.device.type == "cuda":
            rank_state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        self.checkpointer.save(self.step_count, self.model, self.optimizer, meta=meta, rank_state=rank_state)

    def checkpoint_or_report(self, write: Any) -> str:
        """Run `write` (a save or the pending commit); a failed write (e.g. a full disk) is logged and returned, the
        previous checkpoint stays and training goes on. Returns '' or the error."""
        try:
            write()
        except CheckpointWriteError as exc:
            if self.topo.group_rank == 0:
                logger.error("%s; training goes on", exc)
            return str(exc)
        return ""

    def resume(self) -> dict[str, Any]:
        """Load this group's newest usable checkpoint: shards, optimizer, schedule, data position, RNG; return its
        meta. A damaged newest one is skipped for the one before (one log line says which and why); a run whose
        optimizer, learning rate, schedule or precision differ from the checkpoint's is refused (ConfigError)."""
        if self.checkpointer is None:
            raise RuntimeError("no --checkpoint-dir configured")
        checkpoint, meta, rank_state, skipped = self.checkpointer.restore(
            self.model, self.optimizer, check=lambda path: check_compatible(self.cfg, path))
        if skipped and self.topo.group_rank == 0:
            logger.warning("resume: skipped %s in %s; resuming from %s", "; ".join(skipped),
                           self.checkpointer.directory, checkpoint.name)
        self.schedule_steps = schedule_span(meta)  # the series' schedule, whatever --steps is now
        self.scheduler.lr_lambdas = [lr_lambda(self.cfg, self.schedule_steps) for _ in self.scheduler.lr_lambdas]
        self.set_clock({"step": meta["step"], "scheduler": meta["scheduler"]})
        self.stream.load_state(rank_state["stream"])
        if self.outer is not None:
            self.outer.tokens = list(rank_state["fragment_tokens"])
        if "outer" in rank_state:
            self.shard_sync.load_outer_state_dict(rank_state["outer"])
        torch.set_rng_state(rank_state["rng"])
        if "cuda_rng" in rank_state:
            torch.cuda.set_rng_state(rank_state["cuda_rng"], self.device)
        self.set_anchor()
        self.resumed_from = (int(meta["step"]), checkpoint)
        if self.is_logger:
            logger.info("%s", resumed_line(checkpoint, meta, self.cfg))
        return meta

    def save_pretrained(self, directory: str) -> None:
        """Write federation group 0's model + tokenizer as a Hugging Face checkpoint, each rank its own rows
        (collective in group 0; replica 0 writes under HSDP), in the run's `save-dtype`."""
        if self.topo.fed_index != 0:
            return
        save_sharded_pretrained(self.model, directory, group=self.topo.group_pg,
                                dtype=getattr(torch, self.cfg.output.save_dtype), tokenizer=self.tokenizer)

    def window_stats(self, loss_sum: torch.Tensor, steps: int) -> tuple[float, float]:
        """(mean loss over all ranks of the last `steps` steps, peak memory in MiB of the largest rank)."""
        stats = torch.tensor([float(steps), self.throughput.peak_memory_mib()], dtype=torch.float64,
                             device=self.device)
        losses = torch.stack([loss_sum.to(torch.float64), stats[0]])
        dist.all_reduce(losses)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        return float(losses[0] / losses[1]), float(stats[1])

    # ----- the static loop ------------------------------------------------------------------------------------
    def run(self, run_dir: Any = None) -> dict[str, Any]:
        """Train `cfg.steps` steps with syncs every A steps, logging and evaluating; returns the final metrics.

        `run_dir`: the `flwr_sharded.run_dir.RunDir` that rank 0 writes records to (None elsewhere).
        """
        from flwr_sharded.training.metrics import progress_bar

        cfg, p = self.cfg, self.cfg.parallel
        if cfg.checkpoint.resume and self.resumed_from is None:
            self.resume()
        out = cfg.output
        bar = progress_bar(cfg.steps, enabled=self.is_logger and out.progress, initial=self.step_count)
        world_tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.data.seq_len * p.world_size
        started = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        window_start, window_steps, syncs = time.perf_counter(), 0, 0
        last: dict[str, Any] = {}
        pace = Pace(p.aggregate_every, adapt=p.group_steps == "speed", member=self.topo.fed_index)

        def stamp(record: dict[str, Any]) -> dict[str, Any]:
            seen = pace.tokens if pace.adapt else self.step_count * world_tokens_per_step  # groups' own steps
            record.update(elapsed_s=time.perf_counter() - started, tokens_seen=seen)
            if run_dir is not None:
                run_dir.log(record)
            return record

        federation = StaticFederation(self.topo, wait_timeout=cfg.timeout_s) if p.federated and p.sync else None
        if federation is not None and p.sync_retries:
            self.outer.keep_rollback_point()
        failures, tick, last_tick = 0, None, 0
        try:
            while not pace.finished(self.step_count, cfg.steps):
                loss_sum += self.timed_step(pace)
                window_steps += 1
                if federation is not None:
                    step = self.step_count
                    outcomes = self.paced_step(pace, federation, run_dir)
                    syncs += sum(o.adopted for o in outcomes)
                    if outcomes and not outcomes[-1].adopted:  # back at the last adopted sync: its steps undone
                        failures += 1
                        stamp(self._sync_failed(outcomes[-1], failures, failed_at=step))
                        pace.restart_period(self.step_count)
                        last_tick = math.floor(pace.reference(self.step_count))  # its steps are logged again
                        loss_sum.zero_()
                        window_start, window_steps, bar.n = time.perf_counter(), 0, self.step_count
                        continue
                    failures = 0 if outcomes else failures
                tick = pace.tick(self.step_count)
                bar.update(1)
                if tick is None:
                    continue
                end = tick >= cfg.steps
                if tick // out.log_every > last_tick // out.log_every or end:
                    last = stamp(self._train_record(loss_sum, window_steps, time.perf_counter() - window_start,
                                                    syncs))
                    self._show(bar, last)
                    loss_sum.zero_()
                    window_start, window_steps = time.perf_counter(), 0
                if (cfg.eval_every and tick // cfg.eval_every > last_tick // cfg.eval_every) or end:
                    evaluated = time.perf_counter()
                    metrics = stamp({"kind": "eval", "step": self.step_count, **self.evaluate()})
                    last.update(metrics)
                    window_start += time.perf_counter() - evaluated  # evaluation is not training time
                if self.checkpointer is not None and (
                        (cfg.checkpoint.every and tick // cfg.checkpoint.every > last_tick // cfg.checkpoint.every)
                        or end):
                    self.checkpoint_or_report(self.save_checkpoint)
                last_tick = tick
            if self.checkpointer is not None:
                self.checkpoint_or_report(self.checkpointer.wait)
        finally:
            if self.outer is not None:
                self.outer.abandon(self.cfg.timeout_s)  # a sync in flight when `steps` ends mid-period is dropped
            bar.close()
        return last

    def timed_step(self, pace: Pace) -> torch.Tensor:
        """One inner step (and a slower group's sleep), its time counted towards the period's step time; with
        `group-steps speed`, the learning-rate schedule at the run's clock."""
        started = time.perf_counter()
        loss = self.step()
        pace.compute_s += time.perf_counter() - started
        if pace.adapt:
            self.follow_clock(pace.reference(self.step_count))
        return loss

    def _show(self, bar: Any, record: dict[str, Any]) -> None:
        """A train record on the progress bar, or in the log without one (rank 0)."""
        from flwr_sharded.training.metrics import train_line

        if self.is_logger and self.cfg.output.progress:
            bar.write(train_line(record, self.cfg.steps))
        elif self.is_logger:
            logger.info("%s", train_line(record, self.cfg.steps))
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def paced_step(self, pace: Pace, federation: StaticFederation, run_dir: Any) -> list[SyncOutcome]:
        """The outer loop after an inner step, at the group's place in its period; after a period's last sync the
        groups exchange their step and sync times (`Pace.exchange`, logged by rank 0 as a "sync_groups" record) and,
        with `group-steps speed`, each takes its next period's steps."""
        step_in_period = pace.step_in_period(self.step_count)
        started = time.perf_counter()
        outcomes = self.outer_step(step_in_period, federation)
        if not outcomes or not outcomes[-1].adopted or step_in_period != pace.steps:
            return outcomes
        timing = pace.exchange(time.perf_counter() - started, pace.steps, federation.leaders,
                               self.topo.group_pg, self.topo.group_rank == 0, federation.members, self.device)
        cfg = self.cfg
        pace.tokens += sum(n * world for n, world in zip(timing["steps"], self.topo.group_worlds)) * (
            cfg.batch_size * cfg.grad_accum * cfg.data.seq_len)
        pace.end_period(self.step_count)
        if pace.adapt:
            self.outer.set_aggregate_every(pace.steps)
        if run_dir is not None:
            run_dir.log({"kind": "sync_groups", "step": self.step_count, "reference_step": pace.periods * pace.A,
                         **timing})
        return outcomes

    def follow_clock(self, reference: float) -> None:
        """`group-steps speed`: the learning-rate schedule at the run's reference step (the fastest group's)."""
        self.scheduler.last_epoch = math.floor(reference + 1e-9) - 1
        self.scheduler.step()

    def outer_step(self, step_in_period: int, federation: Any, *, apply_rule: bool = True) -> list[SyncOutcome]:
        """The outer loop's part after step `step_in_period` (1..A) of a period: the syncs due, timed as "sync"."""
        if not self.outer.due(step_in_period):
            return []
        with self.timer.phase("sync"):
            return self.outer.after_step(step_in_period, federation, apply_rule=apply_rule)

    def _sync_failed(self, outcome: SyncOutcome, failures: int, failed_at: int) -> dict[str, Any]:
        """A static world's sync failed at step `failed_at` and every rank is back at the last adopted one: the
        record to log, or `SyncFailed` once `sync-retries` failures in a row are spent."""
        retries = self.cfg.parallel.sync_retries
        where = f"the sync of fragment {outcome.fragment} after step {failed_at} failed: {outcome.error}"
        if failures > retries:
            raise SyncFailed(f"{where}; {failures} failed sync(s) in a row, --sync-retries {retries}: stopping")
        if self.is_logger:
            logger.warning("%s; every rank is back at step %d (the last adopted sync), retry %d of %d "
                           "(--sync-retries)", where, self.step_count, failures, retries)
        return {"kind": "sync_failed", "step": failed_at, "restored_step": self.step_count,
                "fragment": outcome.fragment, "error": outcome.error, "blame": outcome.blame, "retry": failures}

    def _train_record(self, loss_sum: torch.Tensor, steps: int, seconds: float, syncs: int) -> dict[str, Any]:
        """Training loss averaged over all ranks, throughput, memory and phase times of the last `steps` steps."""
        cfg = self.cfg
        loss, peak_mib = self.window_stats(loss_sum, steps)
        phases = self.timer.collect()
        world_tokens = steps * cfg.batch_size * cfg.grad_accum * cfg.data.seq_len * cfg.parallel.world_size
        tokens_per_s = world_tokens / max(seconds, 1e-9)
        return {"kind": "train", "step": self.step_count, "loss": loss, "ppl": perplexity(loss),
                "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": tokens_per_s, "step_s": seconds / steps,
                "syncs": syncs, "peak_memory_mib": peak_mib,
                **self.throughput.utilisation(tokens_per_s / cfg.parallel.world_size),
                **{f"{name}_s": value / steps for name, value in phases.items()}}


def local_shards_checksum(model: nn.Module) -> float:
    """Sum of this rank's local shard values (float64): a cheap fingerprint of its weights."""
    total = 0.0
    for param in model.parameters():
        total += float(local_shard(param).detach().double().sum())
    return total


def optimizer_checksum(optimizer: torch.optim.Optimizer) -> float:
    """Sum of this rank's local optimizer state values (moments and step counts, float64): a fingerprint of it."""
    total = 0.0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += float(local_shard(value).detach().double().sum())
    return total
