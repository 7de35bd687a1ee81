"""What one rank does: build the sharded model, run local steps, sync shards every A steps, evaluate, log.

The same `Trainer` runs inside the static torchrun world (`flwr_sharded.train`) and inside a Flower group, which
hands it the federation process groups of each round through `make_sync`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from flwr_sharded.config import TrainConfig, config_to_dict, outer_rule
from flwr_sharded.parallel.sharding import mixed_precision_policy
from flwr_sharded.parallel.sync import ShardSync, SyncStats
from flwr_sharded.parallel.topology import Topology
from flwr_sharded.training import data as data_lib
from flwr_sharded.training.checkpoint import Checkpointer, latest_checkpoint
from flwr_sharded.training.metrics import MetricsWriter, PhaseTimer
from flwr_sharded.training.model_init import build_sharded_model
from flwr_sharded.training.safetensors_writer import save_sharded_pretrained


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to the peak, then cosine decay to `min_lr_ratio` of it at `steps`."""
    o = cfg.optim
    warmup = int(o.warmup * cfg.steps) if o.warmup < 1 else int(o.warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def effective_batch(cfg: TrainConfig) -> int:
    """Sequences behind one optimizer step of one model: the whole world for fsdp/hsdp, one group for FL."""
    p = cfg.parallel
    ranks = p.replicas * p.shards if p.federated else p.world_size
    return ranks * cfg.batch_size * cfg.grad_accum


@dataclass
class StepResult:
    """Outcome of one optimizer step on this rank."""

    loss: torch.Tensor
    """Mean loss over the step's micro-batches (a device tensor: reading it synchronises)."""
    synced: SyncStats | None
    """Stats of the shard sync that followed the step, if one ran."""


class Trainer:
    """One rank of a (F, R, S) run: the sharded model, its optimizer and data, and the shard sync."""

    def __init__(self, cfg: TrainConfig, topo: Topology, *, static_sync: bool = True,
                 partition: tuple[int, int] | None = None) -> None:
        """Build this rank's part of the run.

        Args:
            static_sync: sync over the mesh's "fed" dimension (the static torchrun world). A Flower group passes
                False and installs per-round groups with `make_sync`.
            partition: (federation index, number of federations) for data partitioning when the mesh does not hold
                the federation dimension (a Flower group is one federation group of a larger run).
        """
        self.cfg, self.topo = cfg, topo
        self.device = torch.device(topo.mesh.device_type, torch.cuda.current_device()) \
            if topo.mesh.device_type == "cuda" else torch.device("cpu")
        self.is_logger = dist.get_rank() == 0
        self.tokenizer = data_lib.load_tokenizer(cfg.data)
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

        p = cfg.parallel
        fed_index, num_feds = partition or (topo.fed_index, p.federations)
        self.stream = data_lib.BatchStream(self.blocks, batch_size=cfg.batch_size, fed_index=fed_index,
                                           num_feds=num_feds, dp_index=fed_index * topo.group_world + topo.group_rank,
                                           dp_world=num_feds * topo.group_world, seed=cfg.seed,
                                           partition=cfg.data.partition)
        n_eval = (min(cfg.data.eval_blocks, len(self.blocks.validation)) // topo.group_world) * topo.group_world
        self.eval_data = data_lib.eval_batches(self.blocks, batch_size=cfg.batch_size, group_rank=topo.group_rank,
                                               group_world=topo.group_world, max_blocks=n_eval)
        self.shard_sync: ShardSync | None = None
        if p.federated:
            replica0 = topo.replica_index == 0
            if static_sync:
                self.shard_sync = self.make_sync(topo.fed_group if replica0 else None, topo.rep_group)
            else:  # a Flower group: `shard_sync.rebind` installs each round's groups
                self.shard_sync = self.make_sync(None, None)
            if replica0:  # only replica 0 joins the cross-group step
                self.shard_sync.capture_global()  # the start of the first sync period, for outer optimizers
        self.timer = PhaseTimer(topo.mesh.device_type)
        self.step_count = 0
        self.tokens_since_sync = 0  # this rank's tokens since the last sync
        self.checkpointer = None
        if cfg.checkpoint_dir:
            self.checkpointer = Checkpointer(cfg.checkpoint_dir, fed_index=fed_index, group_rank=topo.group_rank,
                                             group_pg=topo.group_pg, keep=cfg.keep_checkpoints,
                                             async_save=cfg.async_checkpoint)

    # ----- building blocks ------------------------------------------------------------------------------------
    def make_sync(self, fed_group: dist.ProcessGroup | None, rep_group: dist.ProcessGroup | None) -> ShardSync:
        """A ShardSync of this rank's shards over the given federation (and replication) groups."""
        return ShardSync(self.model.named_parameters(), fed_group=fed_group, rep_group=rep_group,
                         bucket_bytes=int(self.cfg.parallel.bucket_mb * (1 << 20)),
                         rule=outer_rule(self.cfg.parallel), wire_dtype=getattr(torch, self.cfg.parallel.sync_dtype))

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
            self.tokens_since_sync += batch.numel()
        with self.timer.phase("optimizer"):
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return total

    def sync(self, *, apply_rule: bool = True) -> SyncStats:
        """Average shards with the other federation groups, weighted by the tokens each processed.

        `apply_rule=False`: stop at the weighted mean (a facility-level sync of a hierarchical federation).
        """
        if self.shard_sync is None:
            raise RuntimeError("this trainer has no federation groups to sync with")
        group_tokens = self.tokens_since_sync * self.topo.group_world  # every rank of a group sees equal-size batches
        with self.timer.phase("sync"):
            stats = self.shard_sync.sync(weight=float(group_tokens), apply_rule=apply_rule)
        self.tokens_since_sync = 0
        if self.cfg.parallel.reset_optimizer_state:
            self.optimizer.state.clear()
        return stats

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
        return {"eval_loss": mean, "eval_ppl": math.exp(mean) if mean < 50 else float("inf")}

    def save_checkpoint(self, extra_meta: dict[str, Any] | None = None) -> None:
        """Checkpoint this group at the current step (collective over the group)."""
        if self.checkpointer is None:
            raise RuntimeError("no --checkpoint-dir configured")
        meta = {"config": config_to_dict(self.cfg), "vocab_size": self.blocks.vocab_size,
                "scheduler": self.scheduler.state_dict(), **(extra_meta or {})}
        rank_state = {"stream": self.stream.state(), "rng": torch.get_rng_state(),
                      "tokens_since_sync": self.tokens_since_sync}
        if self.shard_sync is not None and self.shard_sync.keeps_global:
            rank_state["outer"] = self.shard_sync.outer_state_dict()  # sharded like the parameters
        if self.device.type == "cuda":
            rank_state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        self.checkpointer.save(self.step_count, self.model, self.optimizer, meta=meta, rank_state=rank_state)

    def resume(self) -> dict[str, Any]:
        """Load this group's newest checkpoint: shards, optimizer, schedule, data position, RNG; return its meta."""
        if self.checkpointer is None:
            raise RuntimeError("no --checkpoint-dir configured")
        checkpoint = latest_checkpoint(self.checkpointer.directory)
        if checkpoint is None:
            raise RuntimeError(f"no complete checkpoint in {self.checkpointer.directory}")
        meta, rank_state = self.checkpointer.load(checkpoint, self.model, self.optimizer)
        self.step_count = meta["step"]
        self.scheduler.load_state_dict(meta["scheduler"])
        self.stream.load_state(rank_state["stream"])
        self.tokens_since_sync = rank_state["tokens_since_sync"]
        if "outer" in rank_state:
            self.shard_sync.load_outer_state_dict(rank_state["outer"])
        torch.set_rng_state(rank_state["rng"])
        if "cuda_rng" in rank_state:
            torch.cuda.set_rng_state(rank_state["cuda_rng"], self.device)
        return meta

    def save_pretrained(self, directory: str, *, dtype: torch.dtype | None = None) -> None:
        """Write federation group 0's model + tokenizer as a Hugging Face checkpoint, each rank its own rows
        (collective in group 0; replica 0 writes under HSDP). `dtype`: of the saved tensors (default: fp32)."""
        if self.topo.fed_index != 0:
            return
        save_sharded_pretrained(self.model, directory, group=self.topo.group_pg, dtype=dtype,
                                tokenizer=self.tokenizer)

    # ----- the static loop ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train `cfg.steps` steps with syncs every A steps, logging and evaluating; returns the final metrics."""
        cfg, p = self.cfg, self.cfg.parallel
        if cfg.resume:
            self.resume()
        writer = MetricsWriter(cfg.metrics, cfg.tensorboard, enabled=self.is_logger)
        bar = _progress(cfg.steps, enabled=self.is_logger and cfg.progress, initial=self.step_count)
        if self.is_logger and not cfg.resume:
            writer.write({"kind": "config", "layout": self.topo.describe(), "effective_batch": effective_batch(cfg),
                          "effective_batch_tokens": effective_batch(cfg) * cfg.data.seq_len,
                          "parameters": sum(p_.numel() for p_ in self.model.parameters())})
        loss_sum = torch.zeros((), device=self.device)
        window_start, window_steps, syncs = time.perf_counter(), 0, 0
        last: dict[str, Any] = {}
        try:
            while self.step_count < cfg.steps:
                loss_sum += self.step()
                window_steps += 1
                if p.federated and p.sync and self.step_count % p.aggregate_every == 0:
                    self.sync()
                    syncs += 1
                if self.step_count % cfg.log_every == 0 or self.step_count == cfg.steps:
                    last = self._log_window(loss_sum, window_steps, time.perf_counter() - window_start, syncs)
                    writer.write(last)
                    bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}")
                    loss_sum.zero_()
                    window_start, window_steps = time.perf_counter(), 0
                if (cfg.eval_every and self.step_count % cfg.eval_every == 0) or self.step_count == cfg.steps:
                    metrics = {"kind": "eval", "step": self.step_count, **self.evaluate()}
                    writer.write(metrics)
                    last.update(metrics)
                    window_start = time.perf_counter()  # evaluation is not training time
                if self.checkpointer is not None and (
                        (cfg.checkpoint_every and self.step_count % cfg.checkpoint_every == 0)
                        or self.step_count == cfg.steps):
                    self.save_checkpoint()
                bar.update(1)
            if self.checkpointer is not None:
                self.checkpointer.wait()
            if cfg.save:
                self.save_pretrained(cfg.save)
        finally:
            bar.close()
            writer.close()
        return last

    def _log_window(self, loss_sum: torch.Tensor, steps: int, seconds: float, syncs: int) -> dict[str, Any]:
        """Training loss averaged over all ranks, throughput and phase times of the last `steps` steps."""
        cfg = self.cfg
        stats = torch.stack([loss_sum.to(torch.float64), torch.tensor(float(steps), dtype=torch.float64,
                                                                      device=self.device)])
        dist.all_reduce(stats)
        loss = float(stats[0] / stats[1])
        phases = self.timer.collect()
        world_tokens = steps * cfg.batch_size * cfg.grad_accum * cfg.data.seq_len * cfg.parallel.world_size
        return {"kind": "train", "step": self.step_count, "loss": loss, "ppl": math.exp(min(loss, 50)),
                "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": world_tokens / max(seconds, 1e-9),
                "step_s": seconds / steps, "syncs": syncs,
                **{f"{name}_s": value / steps for name, value in phases.items()}}


def _progress(total: int, enabled: bool, initial: int = 0):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)


def local_shards_checksum(model: nn.Module) -> float:
    """Sum of this rank's local shard values (float64): a cheap fingerprint of its weights."""
    total = 0.0
    for param in model.parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        total += float(local.detach().double().sum())
    return total
