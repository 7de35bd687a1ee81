"""Typed run configuration: one dataclass per concern, filled from YAML and the command line, validated up front.

Every field carries a docstring. `validate_*` functions raise `ConfigError` naming the option and its allowed values;
they run before any process group, model or file is touched.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from flwr_sharded.errors import ConfigError

METHODS = ("fsdp", "hsdp", "fl-fsdp", "fl-hsdp")
Method = Literal["fsdp", "hsdp", "fl-fsdp", "fl-hsdp"]
OPTIMIZERS = ("adamw", "sgd")
PARTITIONS = ("iid", "iid-groups", "document")
PRECISIONS = ("auto", "fp32", "bf16")
SYNC_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""Wire dtypes of the shard sync (`ParallelConfig.sync_dtype`) and their bytes per parameter."""
SYNC_DTYPES = tuple(SYNC_DTYPE_BYTES)


def default_data_dir() -> str:
    """`$FLWR_SHARDED_DATA`, else `~/.cache/flwr_sharded`."""
    return os.environ.get("FLWR_SHARDED_DATA", str(Path.home() / ".cache" / "flwr_sharded"))


@dataclass
class ParallelConfig:
    """How processes are arranged: F federation groups x R replication groups x S sharding groups."""

    method: Method = "fl-fsdp"
    """Training scheme: fsdp = (1, 1, S), hsdp = (1, R, S), fl-fsdp = (F, 1, S), fl-hsdp = (F, R, S)."""
    federations: int = 1
    """F: number of federation groups; each trains its own model copy, averaged every `aggregate_every` steps."""
    replicas: int = 1
    """R: replication groups inside a federation group (HSDP when > 1)."""
    shards: int = 1
    """S: ranks one model replica is sharded over; innermost mesh dimension (keep it inside a node)."""
    aggregate_every: int = 8
    """A: optimizer steps between two shard syncs (FL methods only)."""
    bucket_mb: float = 64.0
    """Size of one flat buffer used by the shard sync, in MiB; one collective per bucket."""
    reset_optimizer_state: bool = False
    """Clear the inner optimizer's state (e.g. Adam moments) after each sync; by default it stays local and kept."""
    sync: bool = True
    """Run the shard sync of FL methods; `false` gives the no-sync limit (independent groups), for benchmarks."""
    outer: str = "fedavg"
    """How synced shards are combined: fedavg, fedavgm, nesterov (DiLoCo), fedadam, fedyogi or trimmed-mean."""
    outer_lr: float | None = None
    """Outer learning rate; None: the rule's default (fedavgm 1.0, nesterov 0.7, fedadam 0.1, fedyogi 0.01)."""
    outer_momentum: float | None = None
    """Outer momentum of fedavgm / nesterov; None: 0.9."""
    sync_dtype: str = "float32"
    """Wire dtype of the cross-group all-reduce: float32 or bfloat16. bfloat16 halves the sync's bytes by sending the
    weighted delta from the last global model (the outer gradient, as DiLoCo does), so only that delta is rounded;
    it costs one fp32 copy of the rank's shards for fedavg (outer optimizers keep one already) and a half-size
    bucket. Not with trimmed-mean (it gathers every member's shards)."""

    @property
    def world_size(self) -> int:
        return self.federations * self.replicas * self.shards

    @property
    def federated(self) -> bool:
        return self.method.startswith("fl-")


@dataclass
class ModelConfig:
    """Which model to train and how to shard it."""

    name: str = "small"
    """A preset (see `flwr_sharded.training.models.PRESETS`), a Hugging Face model id, or a local model directory."""
    precision: str = "auto"
    """Parameter dtype during compute: auto (bf16 on GPU, fp32 on CPU), fp32 or bf16; reductions always in fp32."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3); false keeps them until backward (ZeRO-2-like, more memory)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward to save memory."""
    pretrained: bool = False
    """For hub ids or local directories: load the weights (true) or only the architecture with random init (false)."""


@dataclass
class DataConfig:
    """Where training text comes from and how it is cut and partitioned."""

    dataset: str = "shakespeare"
    """`shakespeare` (embedded, offline), a Hugging Face dataset id, or a local .txt/.json/.jsonl/.parquet file."""
    data_dir: str = field(default_factory=default_data_dir)
    """Directory holding the prepared corpus, tokenizer and token caches; must exist (`flwr-sharded prepare-data`)."""
    tokenizer: str | None = None
    """Tokenizer id or path; default: the byte-level BPE trained on the embedded corpus, in `data_dir`."""
    dataset_config: str | None = None
    """Configuration (subset) name of a hub dataset, e.g. `tiny` for gsarti/clean_mc4_it."""
    text_field: str = "text"
    """Column holding the text, for json/parquet/hub datasets."""
    seq_len: int = 256
    """Tokens per packed training block."""
    partition: str = "iid"
    """How blocks are split between federation groups: iid (shuffled; a rank's samples depend only on its
    data-parallel index), iid-groups (shuffled, split by group first: disjoint for groups of different sizes) or
    document (contiguous documents)."""
    max_train_blocks: int | None = None
    """Use at most this many training blocks (the paper used the first 65,536); None: all."""
    eval_blocks: int = 64
    """Held-out blocks used for each evaluation, split across the ranks of a group."""


@dataclass
class OptimConfig:
    """Inner optimizer and learning-rate schedule of each group."""

    optimizer: str = "adamw"
    """adamw or sgd (plain SGD: no momentum, no weight decay unless set)."""
    lr: float = 3e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    warmup: float = 0.1
    """Linear warm-up length: a fraction of `steps` if < 1, else a number of steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of `lr`; a schedule of constant `lr` results from warmup=0 and 1.0."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (across all shards) to this value; 0 turns clipping off."""


@dataclass
class TrainConfig:
    """A whole training run: parallel layout, model, data, optimizer and loop settings."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Process layout and shard sync."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and sharding policy."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    steps: int = 200
    """Optimizer steps per rank."""
    batch_size: int = 8
    """Sequences per rank per micro-batch."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    seed: int = 42
    """Seed for model init, data order and partitioning."""
    eval_every: int = 50
    """Evaluate held-out perplexity every N steps (and at the end); 0: only at the end."""
    log_every: int = 10
    """Log training loss and timings every N steps."""
    metrics: str | None = None
    """Write metrics as JSON lines to this path (rank 0)."""
    tensorboard: str | None = None
    """Also write TensorBoard scalars to this directory (needs the `tensorboard` package)."""
    save: str | None = None
    """At the end, write federation group 0's model, merged from its shards, with `save_pretrained` here."""
    checkpoint_dir: str | None = None
    """Write sharded checkpoints (one series per federation group) under this directory."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (and at the end); 0: only at the end (when `checkpoint_dir` is set)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept per group; older ones are deleted once a newer one is complete."""
    async_checkpoint: bool = False
    """Write checkpoints in a background thread; the commit (rename) happens at the next save or at the end."""
    resume: bool = False
    """Continue from the newest complete checkpoint in `checkpoint_dir` (model, optimizer, schedule, data, RNG)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    timeout_s: float = 600.0
    """Timeout of every collective (seconds)."""


SECTIONS = {"parallel": ParallelConfig, "model": ModelConfig, "data": DataConfig, "optim": OptimConfig}


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _check_keys(mapping: dict[str, Any], cls: type, where: str) -> None:
    unknown = sorted(set(mapping) - _field_names(cls))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} in {where}; allowed: {sorted(_field_names(cls))}")


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build a TrainConfig from a nested dict (the YAML layout), rejecting unknown keys."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping, got {type(raw).__name__}")
    raw = {k.replace("-", "_"): v for k, v in raw.items()}
    _check_keys(raw, TrainConfig, "the top level")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"section '{key}' must be a mapping")
            value = {k.replace("-", "_"): v for k, v in value.items()}
            _check_keys(value, SECTIONS[key], f"section '{key}'")
            if "betas" in value:
                value["betas"] = tuple(value["betas"])
            kwargs[key] = SECTIONS[key](**value)
        else:
            kwargs[key] = value
    return TrainConfig(**kwargs)


def load_config(path: str | Path) -> TrainConfig:
    """Read a YAML file laid out like `config_to_dict`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: file {path} does not exist")
    with path.open() as fh:
        return config_from_dict(yaml.safe_load(fh) or {})


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["optim"]["betas"] = list(out["optim"]["betas"])
    return out


def _positive(value: Any, option: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{option} must be an integer >= 1, got {value!r}")


def outer_rule(p: ParallelConfig):
    """The shard rule the sync applies (`flwr_sharded.parallel.outer`); ConfigError for a bad name or option.

    For the built-in rules, an option the rule does not take or a value out of range is an error naming the option
    (custom rules check their own keyword arguments).
    """
    from flwr_sharded.parallel.outer import RULES, make_rule

    options = {k: v for k, v in (("lr", p.outer_lr), ("momentum", p.outer_momentum)) if v is not None}
    if p.outer in RULES:
        takes = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in RULES.items()}
        for key in options:
            if key not in takes[p.outer]:
                users = [name for name, fields in takes.items() if key in fields]
                raise ConfigError(f"--outer-{key} does not apply to --outer {p.outer}; only {', '.join(users)} "
                                  f"take it")
        if "lr" in options and not options["lr"] > 0:
            raise ConfigError(f"--outer-lr must be > 0, got {options['lr']}")
        if "momentum" in options and not 0 <= options["momentum"] < 1:
            raise ConfigError(f"--outer-momentum must be in [0, 1), got {options['momentum']}")
    return make_rule(p.outer, **options)


def validate_parallel(p: ParallelConfig, world_size: int | None = None) -> None:
    """Check the layout against the method and (when known) the launched world size."""
    if p.method not in METHODS:
        raise ConfigError(f"--method must be one of {', '.join(METHODS)}; got {p.method!r}")
    for option, value in (("--federations", p.federations), ("--replicas", p.replicas), ("--shards", p.shards),
                          ("--aggregate-every", p.aggregate_every)):
        _positive(value, option)
    if not p.federated and p.federations != 1:
        raise ConfigError(f"--method {p.method} trains one model: --federations must be 1 (got {p.federations}); "
                          f"use fl-{p.method} to federate {p.federations} groups")
    if p.method in ("fsdp", "fl-fsdp") and p.replicas != 1:
        hybrid = "hsdp" if p.method == "fsdp" else "fl-hsdp"
        raise ConfigError(f"--method {p.method} has no replication: --replicas must be 1 (got {p.replicas}); "
                          f"use {hybrid} for R > 1")
    rule = outer_rule(p)
    if p.sync_dtype not in SYNC_DTYPES:
        raise ConfigError(f"--sync-dtype must be one of {', '.join(SYNC_DTYPES)}; got {p.sync_dtype!r}")
    if p.sync_dtype != "float32" and not rule.linear:
        raise ConfigError(f"--sync-dtype {p.sync_dtype} sends one delta per group through an all-reduce, but "
                          f"--outer {p.outer} needs every member's shards; use --sync-dtype float32 or a linear "
                          f"rule")
    if p.bucket_mb <= 0:
        raise ConfigError(f"--bucket-mb must be > 0, got {p.bucket_mb}")
    if world_size is not None and world_size != p.world_size:
        raise ConfigError(f"world size {world_size} != F*R*S = {p.federations}*{p.replicas}*{p.shards} = "
                          f"{p.world_size}; launch {p.world_size} processes or change --federations/--replicas/--shards")


def validate(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Validate a whole run configuration; raises ConfigError on the first problem."""
    validate_parallel(cfg.parallel, world_size)
    for option, value in (("--steps", cfg.steps), ("--batch-size", cfg.batch_size), ("--grad-accum", cfg.grad_accum),
                          ("--seq-len", cfg.data.seq_len), ("--log-every", cfg.log_every)):
        _positive(value, option)
    if not isinstance(cfg.eval_every, int) or cfg.eval_every < 0:
        raise ConfigError(f"--eval-every must be an integer >= 0, got {cfg.eval_every!r}")
    if cfg.optim.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}; got {cfg.optim.optimizer!r}")
    if not cfg.optim.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {cfg.optim.lr}")
    if cfg.optim.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be >= 0, got {cfg.optim.weight_decay}")
    if cfg.optim.grad_clip < 0:
        raise ConfigError(f"--grad-clip must be >= 0 (0 turns clipping off), got {cfg.optim.grad_clip}")
    if cfg.optim.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {cfg.optim.warmup}")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {cfg.optim.min_lr_ratio}")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {cfg.optim.betas}")
    if cfg.data.partition not in PARTITIONS:
        raise ConfigError(f"--partition must be one of {', '.join(PARTITIONS)}; got {cfg.data.partition!r}")
    if cfg.model.precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}; got {cfg.model.precision!r}")
    if cfg.data.eval_blocks < 0:
        raise ConfigError(f"--eval-blocks must be >= 0, got {cfg.data.eval_blocks}")
    if cfg.data.max_train_blocks is not None:
        _positive(cfg.data.max_train_blocks, "--max-train-blocks")
    if not isinstance(cfg.checkpoint_every, int) or cfg.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be an integer >= 0, got {cfg.checkpoint_every!r}")
    if not isinstance(cfg.keep_checkpoints, int) or cfg.keep_checkpoints < 1:
        raise ConfigError(f"--keep-checkpoints must be an integer >= 1, got {cfg.keep_checkpoints!r}")
    if (cfg.resume or cfg.checkpoint_every or cfg.async_checkpoint) and not cfg.checkpoint_dir:
        raise ConfigError("--resume, --checkpoint-every and --async-checkpoint need --checkpoint-dir")
    if cfg.timeout_s <= 0:
        raise ConfigError(f"--timeout must be > 0, got {cfg.timeout_s}")
