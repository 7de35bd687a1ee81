"""What one rank trains with: the sharded model, its optimizer and learning-rate schedule, its data, and its inner
step; evaluation, checkpoints and the exported model. The sync periods around the steps are `sync_loop.SyncLoop`'s.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flwr_sharded import host_memory
from flwr_sharded.config import TrainConfig, config_to_dict
from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.parallel.sharding import mixed_precision_policy, reshard_all
from flwr_sharded.parallel.topology import Topology
from flwr_sharded.run_dir import perplexity
from flwr_sharded.training import data as data_lib
from flwr_sharded.training.checkpoint import CheckpointWriteError, Checkpointer, write_group
from flwr_sharded.training.checkpoint_resume import check_compatible, resumed_line, schedule_span
from flwr_sharded.training.metrics import PhaseTimer, Throughput
from flwr_sharded.training.model_init import build_sharded_model
from flwr_sharded.training.partition import BatchStream, eval_batches
from flwr_sharded.training.proximal import ProximalTerm
from flwr_sharded.training.hf_writer import save_sharded_pretrained

logger = logging.getLogger(__name__)


def fused_on(params: list[torch.Tensor]) -> bool:
    """Whether AdamW runs fused (one kernel per parameter group, no foreach temporaries): parameters on CUDA."""
    return bool(params) and all(p.device.type == "cuda" for p in params)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.optimizer == "adamw":
        params = list(model.parameters())
        return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                                 fused=True if fused_on(params) else None)
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
    """One rank of a (F, R, S) run: the sharded model, its optimizer, schedule and data.

    Args:
        partition: (federation index, number of federations) for data partitioning when the mesh does not hold the
            federation dimension (a Flower group is one federation group of a larger run).
    """

    def __init__(self, cfg: TrainConfig, topo: Topology, *, partition: tuple[int, int] | None = None) -> None:
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
        self.schedule_span = cfg.steps
        """The steps the schedule spans: the run's, or a resumed checkpoint's (`checkpoint_resume.schedule_span`)."""
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
        self.proximal_mu = cfg.optim.proximal_mu
        """FedProx's mu of the current round (0: off)."""
        self.proximal = ProximalTerm(self.model)
        self.timer = PhaseTimer(topo.mesh.device_type)
        self.step_count = 0
        self.reduce_every_micro_batch = True
        """With `grad_accum` > 1: reduce-scatter each micro-batch's gradients into the sharded ones (HSDP's replica
        all-reduce once, at the last); False: hold the whole model's unsharded fp32 gradients until the last
        micro-batch (fewer collectives, far more memory)."""
        self._stepped = False
        self.checkpointer = None
        if cfg.checkpoint.dir:
            async_pg = None
            if cfg.checkpoint.async_save:  # every rank builds every group's, here, in the same order
                async_pg = write_group([topo.group_ranks(f) for f in range(len(topo.group_worlds))], topo.fed_index,
                                       cfg.timeout_s)
            self.checkpointer = Checkpointer(cfg.checkpoint.dir, fed_index=fed_index, group_rank=topo.group_rank,
                                             group_pg=topo.group_pg, keep=cfg.checkpoint.keep,
                                             async_save=cfg.checkpoint.async_save, async_pg=async_pg)
        self.throughput = Throughput(self.model, cfg, self.device)

    def step(self) -> torch.Tensor:
        """One optimizer step (with gradient accumulation and clipping); returns the mean loss as a tensor."""
        cfg = self.cfg
        self.model.train()
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            batch = next(self.stream).to(self.device, non_blocking=True)
            last = micro == cfg.grad_accum - 1
            if self.reduce_every_micro_batch:
                self.model.set_requires_all_reduce(last)
            else:
                self.model.set_requires_gradient_sync(last)
            with self.timer.phase("forward"):
                loss = self.model(input_ids=batch, labels=batch).loss / cfg.grad_accum
            with self.timer.phase("backward"):
                loss.backward()
            total += loss.detach()
        with self.timer.phase("optimizer"):
            if self.proximal_mu > 0:
                self.proximal.add_gradient(self.proximal_mu)
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        if not self._stepped:  # the optimizer's state exists: the long-lived buffers are in place
            self._stepped = True
            host_memory.after_first_step()
        return total

    def set_anchor(self, params: list[nn.Parameter] | None = None) -> None:
        """FedProx: the current shards (of `params`, or all) become w_sync when mu > 0; otherwise the anchor's
        memory is freed."""
        if self.proximal_mu > 0:
            self.proximal.set_anchor(params)
        else:
            self.proximal.release()

    def set_peak_lr(self, lr: float) -> None:
        """Make `lr` the schedule's peak from the next step on (the schedule's shape is kept)."""
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["lr"] = lr * factor(self.scheduler.last_epoch)

    # ----- the clock: step count and learning-rate schedule -----------------------------------------------------
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
        """The learning-rate schedule's step (the step count, unless the schedule follows another clock)."""
        return int(self.scheduler.last_epoch)

    def move_schedule(self, reference: float) -> None:
        """The learning rate of the schedule's step `reference` (rounded down) from now on: a group that takes
        fewer steps per period than the run's clock follows that clock."""
        self.scheduler.last_epoch = math.floor(reference + 1e-9) - 1
        self.scheduler.step()

    # ----- evaluation, checkpoints, export ------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss and perplexity, averaged over every rank's slice (and over groups). The model is resharded
        after it: FSDP2 leaves a unit gathered after a forward with no backward (the root, or every unit with
        `reshard-after-forward` off), and the next forward would use those copies, not the shards a merge, catch-up or
        restore writes in the meantime."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        try:
            for batch in self.eval_data:
                batch = batch.to(self.device)
                loss = self.model(input_ids=batch, labels=batch).loss
                predicted = batch.shape[0] * (batch.shape[1] - 1)
                sums += torch.tensor([loss.item() * predicted, predicted], dtype=torch.float64, device=self.device)
        finally:
            reshard_all(self.model)
        dist.all_reduce(sums)
        mean = float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
        return {"eval_loss": mean, "eval_ppl": perplexity(mean)}

    def save_checkpoint(self, extra_meta: dict[str, Any] | None = None,
                        extra_state: dict[str, Any] | None = None) -> None:
        """Checkpoint this group at the current step (collective over the group); `extra_state`: this rank's part
        of the sync loop's state."""
        if self.checkpointer is None:
            raise RuntimeError("no --checkpoint-dir configured")
        meta = {"config": config_to_dict(self.cfg), "vocab_size": self.blocks.vocab_size,
                "scheduler": self.scheduler.state_dict(), "schedule_steps": self.schedule_span, **(extra_meta or {})}
        rank_state = {"stream": self.stream.state(), "rng": torch.get_rng_state(), **(extra_state or {})}
        if self.device.type == "cuda":
            rank_state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        self.checkpointer.save(self.step_count, self.model, self.optimizer, meta=meta, rank_state=rank_state)

    def checkpoint_or_report(self, write: Any) -> str:
        """Run `write` (a save or the pending commit); a failed write (e.g. a full disk) is logged and returned, the
        previous checkpoint stays (a Flower group reports it to the ServerApp). Returns '' or the error."""
        try:
            write()
        except CheckpointWriteError as exc:
            if self.topo.group_rank == 0:
                logger.error("%s; training goes on", exc)
            return str(exc)
        self.checkpointer.prune()
        return ""

    def resume(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load this group's newest usable checkpoint: shards, optimizer, schedule, data position, RNG; return its
        meta and this rank's state. A damaged newest one is skipped for the one before (one log line says which and
        why); a run whose optimizer, learning rate, schedule or precision differ from the checkpoint's is refused
        (ConfigError)."""
        if self.checkpointer is None:
            raise RuntimeError("no --checkpoint-dir configured")
        checkpoint, meta, rank_state, skipped = self.checkpointer.restore(
            self.model, self.optimizer, check=lambda path: check_compatible(self.cfg, path))
        if skipped and self.topo.group_rank == 0:
            logger.warning("resume: skipped %s in %s; resuming from %s", "; ".join(skipped),
                           self.checkpointer.directory, checkpoint.name)
        self.schedule_span = schedule_span(meta)  # the series' schedule, whatever --steps is now
        self.scheduler.lr_lambdas = [lr_lambda(self.cfg, self.schedule_span) for _ in self.scheduler.lr_lambdas]
        self.set_clock({"step": meta["step"], "scheduler": meta["scheduler"]})
        self.stream.load_state(rank_state["stream"])
        torch.set_rng_state(rank_state["rng"])
        if "cuda_rng" in rank_state:
            torch.cuda.set_rng_state(rank_state["cuda_rng"], self.device)
        self.set_anchor()
        self.resumed_from = (int(meta["step"]), checkpoint)
        if self.is_logger:
            logger.info("%s", resumed_line(checkpoint, meta, self.cfg))
        return meta, rank_state

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


def local_shards_checksum(model: nn.Module) -> float:
    """Sum of this rank's local shard values (float64): a cheap fingerprint of its weights."""
    return sum(float(local_shard(param).detach().double().sum()) for param in model.parameters())


def optimizer_checksum(optimizer: torch.optim.Optimizer) -> float:
    """Sum of this rank's local optimizer state values (moments and step counts, float64): a fingerprint of it."""
    return sum(float(local_shard(value).detach().double().sum()) for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))
