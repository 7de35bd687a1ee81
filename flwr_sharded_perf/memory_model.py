"""What one rank of the trainer holds in memory during a step, term by term and at its peak (docs/cost-model.md)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Literal

from flwr_sharded import schema
from flwr_sharded.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.sparse import RowLayout
from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES, WIRES, SyncDtype
from flwr_sharded_perf.costmodel import positive_int
from flwr_sharded_perf.model_shape import ModelShape
from flwr_sharded.schema import Surface, same_as

GiB = 1024**3
"""Bytes per GiB, for reports."""

# The trainer's facts: bytes per parameter (or per element) of everything it allocates, one declaration each.
MASTER_BYTES = 4
"""Sharded parameters: FSDP2 keeps the model's dtype (fp32); bf16 compute is a copy made by the all-gather."""
GRAD_BYTES = 4
"""Sharded gradients: reduce-scattered in fp32 (`reduce_dtype`) into the parameters' dtype."""
REDUCE_BYTES = 4
"""The reduce-scatter's input: a block's unsharded gradients copied into one fp32 buffer."""
UPCAST_BYTES = 4
"""fp32 copies in the forward: RMSNorm's upcast input, the upcast logits and their log-softmax."""
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}
"""The compute dtype (`precision`): gathered parameters, their gradients and the activations."""
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 0}
"""AdamW's exp_avg and exp_avg_sq in fp32; the trainer's SGD has no momentum."""
OPTIMIZER_FOREACH_TEMP_BYTES = {"adamw": 4, "sgd": 4}
"""On CUDA (foreach kernels over all shards at once): AdamW's sqrt(exp_avg_sq), SGD's gradient + weight decay."""
OPTIMIZER_LOOP_TEMP_PARAMS = {"adamw": 2, "sgd": 1}
"""On CPU (one tensor at a time): temporaries the size of the largest parameter shard (AdamW's sqrt and division)."""
GLOBAL_BYTES = 4
"""The sync's copy of the global shards (fp32), kept by outer optimizers and by a reduced wire dtype."""
RULE_STATE_BYTES = 4
"""Each of an outer rule's state buffers (`ShardRule.state_buffers`, the shard's size) and temporaries (buckets)."""
SNAPSHOT_BYTES = 4
"""An overlapped sync's snapshot of the fragment in flight, and its copy at the start (carry, move check)."""
FEEDBACK_BYTES = 4
"""Error feedback of a quantized or top-k wire: an fp32 residual per value of the shard."""
SPARSE_MAGNITUDE_BYTES = 4
"""A top-k wire's |delta| of the bucket (fp32), from which each chunk's largest entries are chosen."""

# Activations, in elements of the compute dtype per token (h: hidden, kv: k/v width, i: MLP width).
BLOCK_ACTIVATIONS = {"h": 8, "kv": 2, "i": 4}
"""Saved by one block: 2 RMSNorms (3h each), rotated q and attention output (2h), k and v (2kv), the MLP's 4i."""
NORM_UPCASTS_PER_BLOCK = 2
"""RMSNorms per block; each saves its input upcast to fp32 when the compute dtype is narrower (+ (4 - cb) h bytes)."""
OUTSIDE_ACTIVATIONS_H = 3
"""Saved outside the blocks: the final RMSNorm's input, its normalised input and the head's input (3h), + 1 upcast."""
LOGITS_FP32_COPIES = 3
"""fp32 tensors of batch x seq x vocab at the loss's backward: log-softmax output, its gradient and the input's."""
BACKWARD_WORKING_I = 1
"""Activation gradients alive in a block's backward beyond those it frees, in MLP widths (i) per token."""


FIELD_NAMES = Surface(lambda o: o.path[-1])
"""StepOptions' checks name each option by its field name."""


@dataclass(frozen=True)
class StepOptions:
    """The trainer options that decide what a rank holds, each the config's own (`same_as`)."""

    precision: Literal["auto", "fp32", "bf16"] = same_as(ModelConfig, "precision")
    """Compute dtype; auto becomes the trainer's choice on `device` (bf16 on cuda, fp32 on cpu)."""
    optimizer: Literal["adamw", "sgd"] = same_as(OptimConfig, "optimizer")
    outer: str = same_as(ParallelConfig, "outer")
    sync_dtype: SyncDtype = same_as(ParallelConfig, "sync_dtype")
    bucket_mb: float = same_as(ParallelConfig, "bucket_mb")
    grad_accum: int = same_as(TrainConfig, "grad_accum")
    activation_checkpointing: bool = same_as(ModelConfig, "activation_checkpointing")
    reshard_after_forward: bool = same_as(ModelConfig, "reshard_after_forward")
    proximal: bool = False
    """FedProx anchor (`proximal-mu` > 0)."""
    sync_fragments: int = same_as(ParallelConfig, "sync_fragments")
    sync_delay: int = same_as(ParallelConfig, "sync_delay")
    sync_carry: bool | None = same_as(ParallelConfig, "sync_carry")
    sync_error_feedback: bool = same_as(ParallelConfig, "sync_error_feedback")
    sync_topk: float | None = same_as(ParallelConfig, "sync_topk")
    sync_max_move: float = same_as(ParallelConfig, "sync_max_move")
    rollback: bool = False
    """The rollback copy (host memory) a Flower group, and the static engine with `sync-retries` > 0, keep."""
    device: str = "cuda"
    """cuda (foreach optimizer kernels) or cpu (one parameter at a time)."""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"device: choose one of cuda, cpu, got {self.device!r}")
        for name, o in _config_options().items():
            o.check(getattr(self, name), FIELD_NAMES)
        if self.precision == "auto":
            object.__setattr__(self, "precision", "bf16" if self.device == "cuda" else "fp32")
        # unset: the config's default, on with an overlapped sync (`ParallelConfig.carries`)
        object.__setattr__(self, "sync_carry", self.sync_delay > 0 and self.sync_carry is not False)

    @classmethod
    def from_config(cls, cfg: TrainConfig, device: str) -> StepOptions:
        """The options of a `flwr_sharded.config.TrainConfig` run on `device` (cuda or cpu)."""
        config = schema.by_name(TrainConfig)
        values = {name: schema.get(cfg, config[o.name].path) for name, o in _config_options().items()}
        p = cfg.parallel
        return cls(**values, proximal=cfg.optim.proximal_mu > 0, device=device,
                   rollback=p.federated and p.sync and p.sync_retries > 0)


@lru_cache(maxsize=None)
def _config_options() -> dict[str, schema.Option]:
    """StepOptions field -> the TrainConfig option it is (`same_as`), as the config declares it."""
    config = schema.by_name(TrainConfig)
    out = {}
    for f in fields(StepOptions):
        source = f.metadata.get(schema.META, {}).get("same_as")
        if source:
            name = f.metadata[schema.META].get("name") or source[1].replace("_", "-")
            out[f.name] = replace(config[name], path=(f.name,))
    return out


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds, by term (each at its own largest), and the step's phases that sum them."""

    parameters: float
    """Sharded fp32 parameters: 4 P / S."""
    gradients: float
    """Sharded fp32 gradients: 4 P / S (from the reduce-scatters to the optimizer step)."""
    optimizer: float
    """Optimizer state: AdamW's moments, 8 P / S."""
    optimizer_temp: float
    """The optimizer step's temporaries."""
    sync: float
    """FL sync state: its flat bucket (and wire buffer), the fp32 global shards and the outer rule's state."""
    sync_temp: float
    """The outer rule's temporaries during a sync."""
    anchor: float
    """FedProx's copy of the shards."""
    gathered_params: float
    """All-gathered parameters in the compute dtype: the root, and the blocks in flight (all, without reshard)."""
    gathered_grads: float
    """Unsharded gradients before their reduce-scatter: the root's, one block's, and its fp32 reduce-scatter input."""
    activations: float
    """Saved activations of one micro-batch (with checkpointing: the blocks' inputs) and the head's."""
    backward_working: float
    """A block in backward: its recomputed activations (checkpointing) and its activation gradients."""
    logits: float
    """batch x seq x vocab in fp32 at the loss (3 copies)."""
    host: float
    """Host memory, not on the GPU: the rollback copy of the shards, their optimizer state (and outer state)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Bytes at each moment of a step that can be the peak."""

    @property
    def total(self) -> float:
        """Peak bytes per GPU: the largest phase."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def terms(self) -> dict[str, float]:
        """Every term by name (GPU memory), then `host`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "phases"}


def largest_fragment(shape: ModelShape, fragments: int) -> float:
    """Parameters of the largest of `fragments` sync fragments, at most: its blocks, rounded up, and the root's."""
    if not 1 <= fragments <= shape.num_layers:
        raise ConfigError(f"sync_fragments must be in [1, {shape.num_layers}] (one block at least each), "
                          f"got {fragments}")
    block = (shape.num_params - shape.root_params) / shape.num_layers
    return min(float(shape.num_params), -(-shape.num_layers // fragments) * block + shape.root_params)


@lru_cache(maxsize=None)
def _rule(outer: str):
    """The outer rule's class (its declared traits)."""
    from flwr_sharded.parallel.rules import make_rule

    return type(make_rule(outer))


def rule_state_bytes(outer: str) -> float:
    """Bytes per parameter of an outer rule's state (`ShardRule.state_buffers`; scalars ignored)."""
    return float(RULE_STATE_BYTES * _rule(outer).state_buffers)


def _sync_terms(shape: ModelShape, o: StepOptions, *, S: int, F: int) -> tuple[float, float, float]:
    """(sync, sync_temp, outer_state) of one rank: the sync's buffers, the rule's temporaries, its state and copy."""
    shard = shape.num_params / S
    sync = sync_temp = 0.0
    rule = _rule(o.outer) if F > 1 or o.rollback else None
    stateful, linear = (rule.stateful, rule.linear) if rule is not None else (False, True)
    delta = o.sync_dtype != "float32" or o.sync_topk is not None
    if delta and not linear:
        raise ConfigError(f"sync_dtype {o.sync_dtype} (or sync_topk) needs a linear outer rule, not {o.outer}")
    keeps_global = stateful or delta
    outer_state = (GLOBAL_BYTES + rule_state_bytes(o.outer)) * shard if keeps_global else 0.0
    if F > 1:
        bucket = min(int(o.bucket_mb * (1 << 20)) // MASTER_BYTES, shard) * MASTER_BYTES
        wire = bucket / MASTER_BYTES * SYNC_DTYPE_BYTES[o.sync_dtype] if delta else 0.0
        if o.sync_topk is not None:  # |delta| for the selection, this rank's row and the F gathered rows
            row = RowLayout(int(bucket // MASTER_BYTES), o.sync_topk, WIRES[o.sync_dtype]).bytes
            wire = SPARSE_MAGNITUDE_BYTES * bucket / MASTER_BYTES + (F + 1) * row
        sync = bucket + wire + outer_state
        sync_temp = (rule.temp_buckets + F * rule.temp_buckets_per_member) * bucket
        if o.sync_delay > 0:
            origin = o.sync_carry or o.sync_max_move > 0  # the merge adds to it, the plausibility check reads it
            sync += (2 if origin else 1) * SNAPSHOT_BYTES * largest_fragment(shape, o.sync_fragments) / S
        if o.sync_error_feedback:
            sync += FEEDBACK_BYTES * shard
    return sync, sync_temp, outer_state


def trainer_memory(shape: ModelShape, *, S: int, tokens: int, R: int = 1, F: int = 1,
                   options: StepOptions = StepOptions(),
                   state_bytes_per_param: float | None = None) -> MemoryBreakdown:
    """What one rank of an (F, R, S) run holds with `tokens` per micro-batch; `state_bytes_per_param` overrides the
    bytes per parameter of parameters, gradients and optimizer state together (16 with AdamW)."""
    for name, value in (("S", S), ("R", R), ("F", F), ("tokens", tokens)):
        positive_int(name, value)
    o, cb = options, COMPUTE_BYTES[options.precision]
    h, i, L, V = shape.hidden_size, shape.intermediate_size, shape.num_layers, shape.vocab_size
    kv, P, root = shape.kv_size or h, shape.num_params, shape.root_params
    block, shard, scale = (P - root) / L, P / S, 1.0
    if state_bytes_per_param is not None:
        if not state_bytes_per_param > 0:
            raise ConfigError(f"state_bytes_per_param must be positive, got {state_bytes_per_param!r}")
        scale = state_bytes_per_param / (MASTER_BYTES + GRAD_BYTES + OPTIMIZER_STATE_BYTES[o.optimizer])
    grad_bytes = GRAD_BYTES * scale
    parameters, gradients = MASTER_BYTES * scale * shard, grad_bytes * shard
    optimizer = OPTIMIZER_STATE_BYTES[o.optimizer] * scale * shard
    optimizer_temp = OPTIMIZER_FOREACH_TEMP_BYTES[o.optimizer] * shard if o.device == "cuda" else \
        OPTIMIZER_LOOP_TEMP_PARAMS[o.optimizer] * MASTER_BYTES * shape.largest_param() / S
    sync, sync_temp, outer_state = _sync_terms(shape, o, S=S, F=F)
    host = MASTER_BYTES * shard + optimizer + outer_state if o.rollback else 0.0
    anchor = MASTER_BYTES * shard if o.proximal else 0.0

    in_flight = 2 if S > 1 else 1  # the block computing and the next one's all-gather output (S = 1: a copy)
    gathered_first = cb * (root + (in_flight if o.reshard_after_forward else L) * block)
    gathered_last = cb * (root + block)
    grads_block = cb * root + (cb + REDUCE_BYTES) * block  # the root's unsharded gradients live through backward
    grads_root = (cb + REDUCE_BYTES) * root

    upcast = UPCAST_BYTES - cb
    per_block = cb * (BLOCK_ACTIVATIONS["h"] * h + BLOCK_ACTIVATIONS["kv"] * kv + BLOCK_ACTIVATIONS["i"] * i) \
        + NORM_UPCASTS_PER_BLOCK * upcast * h
    kept = cb * h if o.activation_checkpointing else per_block
    outside = tokens * (cb * OUTSIDE_ACTIVATIONS_H * h + upcast * h)
    activations = tokens * L * kept + outside
    backward_working = tokens * (cb * BACKWARD_WORKING_I * i + (per_block if o.activation_checkpointing else 0))
    logits = tokens * LOGITS_FP32_COPIES * UPCAST_BYTES * V

    base = parameters + optimizer + sync + anchor
    phases = {
        "loss backward": base + gathered_first + activations + logits,
        "first block backward": base + gathered_first + activations - outside + backward_working
        + grads_block,
        "last block backward": base + grad_bytes * (L - 1) * block / S + gathered_last + tokens * kept
        + backward_working + grads_block,
        "root reduce-scatter": base + gradients + cb * root + grads_root,
        "optimizer step": base + gradients + optimizer_temp,
    }
    if F > 1:
        phases["shard sync"] = base + sync_temp
    return MemoryBreakdown(parameters=parameters, gradients=gradients, optimizer=optimizer,
                           optimizer_temp=optimizer_temp, sync=sync, sync_temp=sync_temp, anchor=anchor,
                           gathered_params=gathered_first,
                           gathered_grads=max(grads_block, grads_root), activations=activations,
                           backward_working=backward_working, logits=logits, host=host, phases=phases)


def memory_per_gpu(shape: ModelShape, *, S: int, tokens: int, bytes_per_param: float = 2.0,
                   state_bytes_per_param: float | None = None, activation_checkpointing: bool = False,
                   R: int = 1, F: int = 1, options: StepOptions | None = None) -> MemoryBreakdown:
    """`trainer_memory` for `tokens` per GPU per optimizer step, split over `options.grad_accum` micro-batches;
    `bytes_per_param` (the compute dtype: 2 bf16, 4 fp32) and `activation_checkpointing` override `options`."""
    precision = {2.0: "bf16", 4.0: "fp32"}.get(float(bytes_per_param))
    if precision is None:
        raise ConfigError(f"--bytes-per-param: the memory estimate knows 2 (bf16) and 4 (fp32), got {bytes_per_param}")
    options = replace(options or StepOptions(), precision=precision, activation_checkpointing=activation_checkpointing)
    if tokens % options.grad_accum:
        raise ConfigError(f"{tokens} tokens per GPU do not split into {options.grad_accum} micro-batches")
    return trainer_memory(shape, S=S, R=R, F=F, tokens=tokens // options.grad_accum, options=options,
                          state_bytes_per_param=state_bytes_per_param)
