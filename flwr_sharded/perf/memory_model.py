"""What one rank of the trainer holds in memory during a step, term by term, from the trainer's own facts.

The trainer (`training/trainer.py`) keeps FSDP2-sharded fp32 parameters (bf16 is a compute copy made by the
all-gather, `parallel/sharding.py`), fp32 sharded gradients, the optimizer's state, and for FL the shard sync's state
(`parallel/sync.py`). HSDP replicates over R and shards over S, so only S divides the per-rank state. During a step
a rank also holds the all-gathered blocks in flight, unsharded gradients before their reduce-scatter, the saved
activations of one micro-batch and the logits. Not every term lives at the same time: the peak is the largest of
the `phases` of a step, each a sum of the terms alive then; `total` is that peak.

Activation coefficients (bytes per token) were counted with saved-tensor hooks on Hugging Face's LlamaForCausalLM
(transformers 5, sdpa attention, no dropout) and the phases checked against the CPU allocator's peak (torch profiler);
`benchmarks/memory_model_check.py` compares the total with the measured peak RSS of the trainer on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from flwr_sharded.config import TrainConfig
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.rule_traits import RULE_TRAITS
from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES
from flwr_sharded.perf.model_shape import ModelShape

# ---------------------------------------------------------------------------------------------------------------------
# The trainer's facts: bytes per parameter (or per element) of everything it allocates, one declaration each.

MASTER_BYTES = 4
"""Sharded parameters: FSDP2 keeps the model's dtype (fp32); bf16 compute is a copy made by the all-gather."""
GRAD_BYTES = 4
"""Sharded gradients: reduce-scattered in fp32 (`reduce_dtype`) into the parameters' dtype."""
REDUCE_BYTES = 4
"""The reduce-scatter's input: a block's unsharded gradients copied into one fp32 buffer."""
ACCUM_BYTES = 4
"""Unsharded gradients kept between micro-batches (`set_requires_gradient_sync(False)`), upcast to fp32."""
FP32_BYTES = 4
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
SYNC_RULE_TEMP_BUCKETS = {"fedavgm": 4, "nesterov": 4, "fedadam": 6, "fedyogi": 6}
"""Bucket-sized fp32 temporaries of an outer rule's step (`outer.py`: delta, new momentum, step, result; Adam also
the second moment and its square root). FedAvg writes into the sync's buffers and has none."""
SNAPSHOT_BYTES = 4
"""An overlapped sync's snapshot of the fragment in flight (fp32; `parallel/streaming.py`), and a carrying sync's
copy of that fragment at its start: one buffer each, sized for the largest fragment."""
FEEDBACK_BYTES = 4
"""Error feedback of an 8-bit wire: an fp32 residual per value of every bucket of the shard (`parallel/quantize.py`)."""
TRIMMED_MEAN_TEMP_BUCKETS_PER_GROUP = 5
"""Trimmed mean: per federation group, its all-gathered bucket, the stack, the sorted values and int64 indices."""

# Activations, in elements of the compute dtype per token (h: hidden, kv: k/v width, i: MLP width).
BLOCK_ACTIVATIONS = {"h": 8, "kv": 2, "i": 4}
"""Saved by one block: 2 RMSNorms (input, normalised, output: 3h each), rotated q, attention output (2h), k and v
(2kv), the MLP's gate, up, SiLU and product (4i)."""
NORM_UPCASTS_PER_BLOCK = 2
"""RMSNorms per block; each saves its input upcast to fp32 when the compute dtype is narrower (+ (4 - cb) h bytes)."""
OUTSIDE_ACTIVATIONS_H = 3
"""Saved outside the blocks: the final RMSNorm's input, its normalised input and the head's input (3h), + 1 upcast."""
LOGITS_FP32_COPIES = 3
"""fp32 tensors of batch x seq x vocab at the loss's backward: log-softmax output, its gradient and the input's."""
BACKWARD_WORKING_I = 1
"""Activation gradients alive in a block's backward beyond those it frees, in MLP widths (i) per token."""


@dataclass(frozen=True)
class StepOptions:
    """The trainer options that decide what a rank holds (defaults as `flwr-sharded train` on a GPU)."""

    precision: str = "bf16"
    """Compute dtype: bf16 or fp32 (`precision`; auto is bf16 on GPU, fp32 on CPU)."""
    optimizer: str = "adamw"
    """adamw or sgd."""
    outer: str = "fedavg"
    """The FL sync's rule (`outer`)."""
    sync_dtype: str = "float32"
    """Wire dtype of the FL sync (`sync-dtype`)."""
    bucket_mb: float = 64.0
    """The FL sync's flat buffer (`bucket-mb`)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    proximal: bool = False
    """FedProx anchor (`proximal-mu` > 0)."""
    sync_fragments: int = 1
    """N: fragments the FL sync cuts the model into (`sync-fragments`)."""
    sync_delay: int = 0
    """tau: steps an overlapped sync runs behind the training (`sync-delay`); > 0 keeps a snapshot of a fragment."""
    sync_carry: bool = False
    """A carrying overlapped sync (`sync-carry`): a second copy of the fragment in flight."""
    error_feedback: bool = False
    """Error feedback of an 8-bit wire (`sync-error-feedback`)."""
    rollback: bool = False
    """A Flower group: its rollback copy of the shards, their optimizer state and the outer state (host memory)."""
    device: str = "cuda"
    """cuda (foreach optimizer kernels) or cpu (one parameter at a time)."""

    def __post_init__(self) -> None:
        for name, allowed in (("precision", COMPUTE_BYTES), ("optimizer", OPTIMIZER_STATE_BYTES),
                              ("sync_dtype", SYNC_DTYPE_BYTES), ("device", ("cuda", "cpu"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}: choose one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name, least in (("grad_accum", 1), ("sync_fragments", 1), ("sync_delay", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be positive, got {self.bucket_mb!r}")

    @classmethod
    def from_config(cls, cfg: TrainConfig, device: str) -> StepOptions:
        """The options of a `flwr_sharded.config.TrainConfig` run on `device` (cuda or cpu)."""
        precision = cfg.model.precision if cfg.model.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
        p = cfg.parallel
        return cls(precision=precision, optimizer=cfg.optim.optimizer, outer=p.outer, sync_dtype=p.sync_dtype,
                   bucket_mb=p.bucket_mb, grad_accum=cfg.grad_accum,
                   activation_checkpointing=cfg.model.activation_checkpointing,
                   reshard_after_forward=cfg.model.reshard_after_forward, proximal=cfg.optim.proximal_mu > 0,
                   sync_fragments=p.sync_fragments, sync_delay=p.sync_delay, sync_carry=p.sync_carry,
                   error_feedback=p.sync_error_feedback, device=device)


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
    accumulated_grads: float
    """Unsharded fp32 gradients of the whole model between micro-batches (grad-accum > 1)."""
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
    """Host memory, not on the GPU: a Flower group's rollback copy of the shards, their optimizer state (and outer
    state)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Bytes at each moment of a step that can be the peak."""

    TERMS = ("parameters", "gradients", "optimizer", "optimizer_temp", "sync", "sync_temp", "anchor",
             "accumulated_grads", "gathered_params", "gathered_grads", "activations", "backward_working", "logits")

    @property
    def total(self) -> float:
        """Peak bytes per GPU: the largest phase."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def states(self) -> float:
        """Parameters, gradients, optimizer and FL state: what stays between steps (and the gradients)."""
        return self.parameters + self.gradients + self.optimizer + self.sync + self.anchor

    @property
    def gathered(self) -> float:
        """Unsharded FSDP2 buffers: gathered parameters and gradients."""
        return self.gathered_params + self.gathered_grads

    def terms(self) -> dict[str, float]:
        """Every term by name (GPU memory), then `host`."""
        return {**{name: getattr(self, name) for name in self.TERMS}, "host": self.host}


def largest_fragment(shape: ModelShape, fragments: int) -> float:
    """Parameters of the largest of `fragments` sync fragments, at most: its share of blocks, rounded up, and every
    parameter outside the blocks (embeddings go with the first fragment, the final norm and head with the last)."""
    if not 1 <= fragments <= shape.num_layers:
        raise ConfigError(f"sync_fragments must be in [1, {shape.num_layers}] (one block at least each), "
                          f"got {fragments}")
    block = (shape.num_params - shape.root_params) / shape.num_layers
    return min(float(shape.num_params), -(-shape.num_layers // fragments) * block + shape.root_params)


@lru_cache(maxsize=None)
def rule_state_bytes(outer: str) -> float:
    """Bytes per parameter of an outer rule's state: a built-in rule's declared traits, else from the rule's own
    `init_state` (scalars ignored)."""
    if outer in RULE_TRAITS:
        return RULE_TRAITS[outer].state_bytes
    import torch

    from flwr_sharded.parallel.outer import make_rule

    rule = make_rule(outer)
    one, two = rule.init_state(torch.zeros(1)), rule.init_state(torch.zeros(2))
    return float(sum(two[k].numel() * two[k].element_size() - one[k].numel() * one[k].element_size() for k in two))


@lru_cache(maxsize=None)
def _rule_traits(outer: str) -> tuple[bool, bool]:
    """(stateful, linear) of an outer rule."""
    if outer in RULE_TRAITS:
        return RULE_TRAITS[outer].stateful, RULE_TRAITS[outer].linear
    from flwr_sharded.parallel.outer import make_rule

    rule = make_rule(outer)
    return rule.stateful, rule.linear


def trainer_memory(shape: ModelShape, *, S: int, tokens: int, R: int = 1, F: int = 1,
                   options: StepOptions = StepOptions(),
                   state_bytes_per_param: float | None = None) -> MemoryBreakdown:
    """What one rank of an (F, R, S) run holds, with `tokens` per micro-batch (batch x seq) on that rank.

    R does not change a rank's memory (HSDP all-reduces the sharded gradients in place); F > 1 adds the sync.
    `state_bytes_per_param` overrides the bytes per parameter of parameters + gradients + optimizer state together
    (the trainer's: 16 with AdamW), for another trainer; the three keep their proportions.
    """
    for name, value in (("S", S), ("R", R), ("F", F), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    o = options
    cb = COMPUTE_BYTES[o.precision]
    h, i, L, V = shape.hidden_size, shape.intermediate_size, shape.num_layers, shape.vocab_size
    kv = shape.kv_size or h
    P, root = shape.num_params, shape.root_params
    block = (P - root) / L
    shard = P / S

    scale = 1.0
    if state_bytes_per_param is not None:
        if not state_bytes_per_param > 0:
            raise ConfigError(f"state_bytes_per_param must be positive, got {state_bytes_per_param!r}")
        scale = state_bytes_per_param / (MASTER_BYTES + GRAD_BYTES + OPTIMIZER_STATE_BYTES[o.optimizer])
    grad_bytes = GRAD_BYTES * scale
    parameters, gradients = MASTER_BYTES * scale * shard, grad_bytes * shard
    optimizer = OPTIMIZER_STATE_BYTES[o.optimizer] * scale * shard
    if o.device == "cuda":
        optimizer_temp = OPTIMIZER_FOREACH_TEMP_BYTES[o.optimizer] * shard
    else:
        optimizer_temp = OPTIMIZER_LOOP_TEMP_PARAMS[o.optimizer] * MASTER_BYTES * shape.largest_param() / S

    sync = sync_temp = host = 0.0
    stateful, linear = _rule_traits(o.outer) if F > 1 or o.rollback else (False, True)
    delta = o.sync_dtype != "float32"
    if delta and not linear:
        raise ConfigError(f"sync_dtype {o.sync_dtype} needs a linear outer rule, not {o.outer}")
    keeps_global = stateful or delta
    outer_state = (GLOBAL_BYTES + rule_state_bytes(o.outer)) * shard if keeps_global else 0.0
    if F > 1:
        bucket = min(int(o.bucket_mb * (1 << 20)) // MASTER_BYTES, shard) * MASTER_BYTES
        wire = bucket / MASTER_BYTES * SYNC_DTYPE_BYTES[o.sync_dtype] if delta else 0.0
        sync = bucket + wire + outer_state
        temps = F * TRIMMED_MEAN_TEMP_BUCKETS_PER_GROUP if o.outer == "trimmed-mean" else \
            SYNC_RULE_TEMP_BUCKETS.get(o.outer, 0)
        sync_temp = temps * bucket
        if o.sync_delay > 0:
            sync += (2 if o.sync_carry else 1) * SNAPSHOT_BYTES * largest_fragment(shape, o.sync_fragments) / S
        if o.error_feedback:
            sync += FEEDBACK_BYTES * shard
    if o.rollback:
        host = MASTER_BYTES * shard + optimizer + outer_state
    anchor = MASTER_BYTES * shard if o.proximal else 0.0
    accumulated = ACCUM_BYTES * P if o.grad_accum > 1 else 0.0

    in_flight = 2 if S > 1 else 1  # the block computing and the next one's all-gather output (S = 1: a copy)
    gathered_first = cb * (root + (in_flight if o.reshard_after_forward else L) * block)
    gathered_last = cb * (root + block)
    grads_block = cb * root + (cb + REDUCE_BYTES) * block  # the root's unsharded gradients live through backward
    grads_root = (cb + REDUCE_BYTES) * root

    upcast = FP32_BYTES - cb
    per_block = cb * (BLOCK_ACTIVATIONS["h"] * h + BLOCK_ACTIVATIONS["kv"] * kv + BLOCK_ACTIVATIONS["i"] * i) \
        + NORM_UPCASTS_PER_BLOCK * upcast * h
    kept = cb * h if o.activation_checkpointing else per_block
    outside = tokens * (cb * OUTSIDE_ACTIVATIONS_H * h + upcast * h)
    activations = tokens * L * kept + outside
    backward_working = tokens * (cb * BACKWARD_WORKING_I * i + (per_block if o.activation_checkpointing else 0))
    logits = tokens * LOGITS_FP32_COPIES * FP32_BYTES * V

    base = parameters + optimizer + sync + anchor
    phases = {
        "loss backward": base + accumulated + gathered_first + activations + logits,
        "first block backward": base + accumulated + gathered_first + activations - outside + backward_working
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
                           accumulated_grads=accumulated, gathered_params=gathered_first,
                           gathered_grads=max(grads_block, grads_root), activations=activations,
                           backward_working=backward_working, logits=logits, host=host, phases=phases)


def memory_per_gpu(shape: ModelShape, *, S: int, tokens: int, bytes_per_param: float = 2.0,
                   state_bytes_per_param: float | None = None, activation_checkpointing: bool = False,
                   R: int = 1, F: int = 1, options: StepOptions | None = None) -> MemoryBreakdown:
    """`trainer_memory` for `tokens` per GPU per optimizer step, in the planner's terms.

    `bytes_per_param`: the compute dtype (2 bf16, 4 fp32); it and `activation_checkpointing` override `options`.
    `tokens` is split over `options.grad_accum` micro-batches.
    """
    precision = {2.0: "bf16", 4.0: "fp32"}.get(float(bytes_per_param))
    if precision is None:
        raise ConfigError(f"--bytes-per-param: the memory estimate knows 2 (bf16) and 4 (fp32), got {bytes_per_param}")
    options = replace(options or StepOptions(), precision=precision, activation_checkpointing=activation_checkpointing)
    if tokens % options.grad_accum:
        raise ConfigError(f"{tokens} tokens per GPU do not split into {options.grad_accum} micro-batches")
    return trainer_memory(shape, S=S, R=R, F=F, tokens=tokens // options.grad_accum, options=options,
                          state_bytes_per_param=state_bytes_per_param)
