"""Typed run configuration: one dataclass per concern, the one declaration of every training option.

Every field carries a docstring and is an option (`flwr_sharded.schema`): the command line of `flwr_sharded.train`,
the YAML layout (`load_config`), the Flower run config (`flwr_sharded.flower.run_config`) and the docs' tables derive
from these fields. `validate` checks what spans several options; it runs before any process group, model or file is
touched, and its messages name each option as the surface spells it.
"""

from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from flwr_sharded import schema
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.plausibility import DEFAULT_MAX_MOVE
from flwr_sharded.parallel.wire import QUANTIZED, SyncDtype  # noqa: F401 - QUANTIZED: for importers
from flwr_sharded.schema import CLI, Surface, option

Method = Literal["fsdp", "hsdp", "fl-fsdp", "fl-hsdp"]
METHODS: tuple[str, ...] = typing.get_args(Method)


def default_data_dir() -> str:
    """`$FLWR_SHARDED_DATA`, else `~/.cache/flwr_sharded`."""
    return os.environ.get("FLWR_SHARDED_DATA", str(Path.home() / ".cache" / "flwr_sharded"))


def data_dir_of(data: DataConfig) -> Path:
    """The data directory a run uses: `data.data_dir`, else the default."""
    return Path(data.data_dir or default_data_dir()).expanduser()


@dataclass
class ParallelConfig:
    """How processes are arranged: F federation groups x R replication groups x S sharding groups."""

    method: Method = "fl-fsdp"
    """Training scheme: fsdp = (1, 1, S), hsdp = (1, R, S), fl-fsdp = (F, 1, S), fl-hsdp = (F, R, S)."""
    federations: int = option(1, ge=1, not_flat="a Flower run federates its groups: F is their number (num-groups)")
    """F: number of federation groups; each trains its own model copy, averaged every `aggregate-every` steps."""
    replicas: int = option(1, ge=1)
    """R: replication groups inside a federation group (HSDP when > 1)."""
    shards: int = option(1, ge=1)
    """S: ranks one model replica is sharded over; innermost mesh dimension (keep it inside a node)."""
    group_shards: str = option("", not_flat="a Flower run's groups each start with their own S (--shards of the "
                                            "group, or facility-shards)")
    """S of each federation group, comma-separated (e.g. 2,4): a federation of groups that shard differently (FL
    methods, static engine), whose shards are averaged piece by piece where they overlap; F is their number, R
    (`replicas`) is every group's, and the world is R x their sum. Unset: F groups of `shards`."""
    aggregate_every: int = option(8, ge=1)
    """A: optimizer steps between two shard syncs (FL methods only)."""
    group_steps: Literal["equal", "speed"] = "equal"
    """How many local steps each federation group trains per sync: equal (every group A), or speed (the fastest
    group trains A, one k times slower about A/k, at least 1), so that groups of different speeds arrive at the sync
    together. The static engine's groups measure and exchange their step times after every sync; in a Flower run the
    strategy takes each member's step time from its last round's reply (a round without one for every member is
    equal). The weights stay the tokens each group trained, and each group's learning-rate schedule (and the static
    engine's logging, evaluation and end of run) follows the fastest group's step count. The time each group idles
    per sync is recorded either way (`sync_groups` records; a Flower round's `idle_s_per_sync`)."""
    bucket_mb: float = option(64.0, gt=0)
    """Size of one flat buffer used by the shard sync, in MiB; one collective per bucket."""
    sync_dtype: SyncDtype = "float32"
    """Wire dtype of the cross-group all-reduce: float32 sends the shards. bfloat16 halves the sync's bytes by sending
    each group's weighted delta from the last global model (the outer gradient, as DiLoCo does), so only that delta
    is rounded; int8, float8_e4m3fn and float8_e5m2 (fp8: CUDA compute capability >= 8.9) quantize the delta
    blockwise (one fp32 scale per 256 values; about 0.254 of the fp32 bytes) and sum it in fp32, int4 and
    float4_e2m1 the same in 4-bit codes, two to a byte (about 0.129 of the fp32 bytes; int4: 18x int8's rounding
    step). Any of them costs
    one fp32 copy of the rank's shards for fedavg (outer optimizers keep one already); linear outer rules only (not
    trimmed-mean or median)."""
    sync_error_feedback: bool = False
    """With a quantized `sync-dtype` (int8, a float8, or a 4-bit one, int4 or float4_e2m1, whose rounding errors
    are the largest) or `sync-topk`: carry each rank's rounding errors (and what top-k did not send) into its next
    sync (error feedback), so they do not accumulate over syncs; one more fp32 copy of the rank's shards."""
    sync_topk: float | None = option(None, gt=0, le=1)
    """Send only this fraction (e.g. 0.02) of each rank's weighted delta, per chunk of 4096 values the largest
    entries, as (index, value) rows in the `sync-dtype` format (float32: a float32 delta), all-gathered and summed on
    every rank (SparseLoCo): about W x fraction x (2 + value bytes) / 8 of the fp32 all-reduce's bytes over W groups
    (0.015x for 2 groups at 2% with int8). Needs `sync-error-feedback` (the residual keeps what is not sent) and a
    linear outer rule; costs one fp32 copy of the shards for fedavg, as a reduced wire does. Unset: dense."""
    sync_fragments: int = option(1, ge=1)
    """N: sync the model in N fragments of contiguous transformer blocks (Streaming DiLoCo), fragment i after step
    round((i + 1) A / N) of each period of A steps, so the link carries about 1/N of the model at a time; each
    fragment has its own outer-rule state. At most one fragment per block and per step of the period."""
    sync_delay: int = option(0, ge=0)
    """tau: start each fragment's sync tau steps before it is merged and reduce it in the background while those
    steps compute (overlap); the arriving global values are then mixed into the local ones (`sync-alpha`). Smaller
    than the fewest steps between two fragments' syncs; 0: the sync blocks training, as without overlap."""
    sync_alpha: float = option(0.0, ge=0, le=1)
    """alpha: when a sync is merged, every shard becomes alpha * local + (1 - alpha) * global (Streaming DiLoCo's
    mixing; 0 adopts the global values, discarding the local steps taken while the sync travelled)."""
    sync_carry: bool | None = None
    """Keep the local steps taken while an overlapped sync travelled (unset: on when `sync-delay` > 0; off:
    `--no-sync-carry`, `false` in YAML or the run config): the global values a merge mixes in become global + (local
    - snapshot), so a shard becomes local + (1 - alpha) * (global - snapshot). Costs one more copy of the largest
    fragment's shards; on with `sync-delay` 0 is an error (there is nothing to keep)."""
    reset_optimizer_state: bool = False
    """Clear the inner optimizer's state (e.g. Adam moments) after each sync; by default it stays local and kept."""
    sync: bool = option(True, not_flat="a Flower run always syncs; the no-sync limit is a static-engine benchmark")
    """Run the shard sync of FL methods; off gives the no-sync limit (independent groups), for benchmarks."""
    sync_retries: int = option(3, ge=0, not_flat="a Flower round ends at a failed sync, every member rolled back; "
                                                 "the strategy's strikes decide what follows (max-strikes)")
    """Static engine: a sync that fails on any member (an error, a timeout, a rejected result) puts every rank back
    at the last adopted sync (shards, outer state, inner optimizer, step and schedule) and training goes on from
    there with fresh batches, at most this many times in a row; then the run stops with the error. 0: stop at the
    first failed sync and keep no rollback copy (host memory: the shards and their inner optimizer state)."""
    sync_max_move: float = option(DEFAULT_MAX_MOVE, ge=0)
    """A sync is adopted only if, on every rank, the groups' result moves each bucket of the rank's shards by at most
    this many times the median of that bucket's recent adopted moves, per token of the rank's weight (before it has
    any: this many times the bucket's own norm), so a member that sends absurd values in spite of its own verdict
    cannot poison the model (docs/security.md: what is measured, and what is not caught); a
    rejected sync is rolled back everywhere, and the member whose values alone explain it is named (struck, in a
    Flower run). An overlapped sync keeps one more copy of the largest fragment's shards to measure the move (as
    `sync-carry` does). 0: only finiteness is checked, and nobody is named."""
    outer: str = "fedavg"
    """How synced shards are combined: fedavg, fedavgm, nesterov (DiLoCo), fedadam, fedyogi, trimmed-mean, median, or
    a `package.module:Class` ShardRule. trimmed-mean and median ignore the weights and all-gather every group's
    shards (F/2 x the bytes of the others' all-reduce; docs/custom-rules.md); a Flower run's server path has
    its own: `server-rule`."""
    outer_lr: float | None = option(None, gt=0)
    """Outer learning rate; unset: the rule's default (fedavgm 1.0, nesterov 0.7, fedadam 0.1, fedyogi 0.01)."""
    outer_momentum: float | None = option(None, ge=0, lt=1)
    """Outer momentum of fedavgm and nesterov; unset: 0.9."""
    backend: Literal["auto", "nccl", "gloo"] = option("auto", not_flat="each group picks its backends when it starts "
                                                                    "(--sync-backend of the group runtime)")
    """Backend of the static world's process groups: auto (NCCL on GPUs, gloo on CPU), or gloo on GPUs too (several
    ranks sharing one GPU, where NCCL refuses, e.g. two groups of S = 1 on a one-GPU machine)."""

    @property
    def carries(self) -> bool:
        """Whether an overlapped sync keeps the local steps taken while it travelled (`sync-carry`, unset: on when
        `sync-delay` > 0); what every user of the option reads."""
        return self.sync_delay > 0 and self.sync_carry is not False

    @property
    def layouts(self) -> tuple[int, ...]:
        """Each federation group's S, in group order: `group-shards` (checked by `validation.validate_parallel`), else F groups
        of `shards`."""
        if self.group_shards:
            return tuple(int(x) for x in self.group_shards.split(","))
        return (self.shards,) * self.federations

    @property
    def unequal(self) -> bool:
        """Whether the federation groups shard differently."""
        return len(set(self.layouts)) > 1

    @property
    def world_size(self) -> int:
        return self.replicas * sum(self.layouts)

    def describe_layout(self) -> str:
        """The world's arithmetic, for messages: 'F*R*S = 2*1*4 = 8' or 'R*(S1+S2) = 1*(2+4) = 6'."""
        if self.group_shards:
            terms = "+".join(f"S{g + 1}" for g in range(len(self.layouts)))
            return f"R*({terms}) = {self.replicas}*({'+'.join(map(str, self.layouts))}) = {self.world_size}"
        return f"F*R*S = {self.federations}*{self.replicas}*{self.shards} = {self.world_size}"

    def describe_sync(self) -> str:
        """The shard sync in one clause, for start-up banners: wire dtype, fragments, outer rule, overlap (e.g.
        "float32, 1 fragment, outer fedavg; no overlap")."""
        if not self.sync:
            return "off (independent groups)"
        feedback = (f" top-k {self.sync_topk:g}" if self.sync_topk else "") + (
            " with error feedback" if self.sync_error_feedback else "")
        fragments = f"{self.sync_fragments} fragment{'s' if self.sync_fragments > 1 else ''}"
        lr = "" if self.outer_lr is None else f" lr {self.outer_lr:g}"
        overlap = (f"overlap tau={self.sync_delay} alpha={self.sync_alpha:g} {'carry' if self.carries else 'no carry'}"
                   if self.sync_delay else "no overlap")
        return f"{self.sync_dtype}{feedback}, {fragments}, outer {self.outer}{lr}; {overlap}"

    @property
    def federated(self) -> bool:
        return self.method.startswith("fl-")


@dataclass
class ModelConfig:
    """Which model to train and how to shard it."""

    name: str = option("small", name="model")
    """A preset (tiny, small, medium, llama-1b, llama-3b, llama3.1-8b), a Hugging Face model id, or a local model
    directory. A hub id or directory brings its own tokenizer unless `tokenizer` is set; presets use the tokenizer
    in `data-dir`."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Parameter dtype during compute: auto (bf16 on GPU, fp32 on CPU), fp32 or bf16; reductions always in fp32."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3); off keeps them until backward (more memory, less traffic)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward to save memory."""
    pretrained: bool = False
    """For hub ids or local directories: load the weights (on) or only the architecture with random init (off)."""


@dataclass
class DataConfig:
    """Where training text comes from and how it is cut and partitioned."""

    dataset: str = "shakespeare"
    """`shakespeare` (embedded, offline), a Hugging Face dataset id, or a local path: a .txt/.json/.jsonl/.parquet
    file (.json.gz, .jsonl.gz too), a directory of such files (`train*` / `*validation*` name the splits), or a copy
    of a hub dataset repository (data files in sub-directories, laid out as on the Hub). Script-based hub datasets
    do not load with datasets >= 4: use their Parquet conversion (`dataset-revision`) or a copy of their files."""
    data_dir: str | None = None
    """Directory holding the prepared corpus, tokenizer and token caches (`flwr-sharded prepare-data`); unset:
    `$FLWR_SHARDED_DATA`, else ~/.cache/flwr_sharded."""
    tokenizer: str | None = None
    """Tokenizer id or path; unset: the model's own when `model` is a Hugging Face id or a local model directory,
    else (presets) the byte-level BPE trained on the embedded corpus, in `data-dir`. It may not hold more tokens
    than the model's embedding (checked before the run starts)."""
    dataset_config: str | None = None
    """Configuration (subset) name of a hub dataset, e.g. `ita_Latn` for HuggingFaceFW/fineweb-2. With
    `dataset-revision refs/convert/parquet`, and for a local repository copy without a README, it names the
    configuration's directory."""
    dataset_revision: str | None = None
    """Git revision (branch, tag or commit) of a hub dataset; pin a commit for reproducible runs, or use
    `refs/convert/parquet`, the Hub's Parquet conversion (of script-based datasets among others); unset: main."""
    streaming: bool = False
    """Read the dataset as a stream (`datasets` streaming) instead of downloading it whole, for corpora that do not
    fit on disk: documents are tokenized until `max-train-blocks` blocks are full (required). Validation comes from
    the `validation` split if there is one, else the first documents are held out until `eval-blocks` blocks are
    full; training starts at the next document."""
    tokenize_workers: int | None = option(None, ge=1)
    """Processes that tokenize a map-style (non-streaming) dataset; unset: min(8, CPUs). The blocks are the same for
    any number. One rank per data directory tokenizes (with a progress bar), the others wait for its cache."""
    text_field: str = "text"
    """Column holding the text, for json, parquet and hub datasets."""
    seq_len: int = option(256, ge=1)
    """Tokens per packed training block."""
    partition: Literal["iid", "iid-groups", "document"] = "iid"
    """How blocks are split between federation groups: iid (shuffled; a rank's samples depend only on its
    data-parallel index), iid-groups (shuffled, split by group first: disjoint for groups of different sizes) or
    document (contiguous documents)."""
    max_train_blocks: int | None = option(None, ge=1)
    """Use at most this many training blocks (the paper used the first 65,536); unset: all."""
    eval_blocks: int = option(64, ge=0)
    """Held-out blocks used for each evaluation, split across the ranks of a group."""


@dataclass
class OptimConfig:
    """Inner optimizer and learning-rate schedule of each group."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw, or sgd (plain SGD: no momentum; weight decay as an L2 penalty)."""
    lr: float = option(3e-4, gt=0)
    """Peak learning rate."""
    beta1: float = option(0.9, ge=0, lt=1)
    """AdamW's first-moment decay."""
    beta2: float = option(0.95, ge=0, lt=1)
    """AdamW's second-moment decay."""
    weight_decay: float = option(0.1, ge=0)
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    warmup: float = option(0.1, ge=0)
    """Linear warm-up length: a fraction of `steps` if < 1, else a number of steps."""
    min_lr_ratio: float = option(0.1, ge=0, le=1)
    """Cosine decay floor as a fraction of `lr`; warmup 0 and ratio 1 give a constant learning rate."""
    grad_clip: float = option(1.0, ge=0)
    """Clip the global gradient norm (across all shards) to this value; 0 turns clipping off."""
    proximal_mu: float = option(0.0, ge=0)
    """FedProx: add mu/2 * ||w - w_sync||^2 to each group's objective, w_sync being its shards after the last sync
    (each rank adds the gradient mu * (w - w_sync) on its own shards); 0 turns it off. FL methods only."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (`torch.distributed.checkpoint`), one series per federation group."""

    dir: str | None = option(None, name="checkpoint-dir")
    """Write sharded checkpoints (one series per federation group) under this directory; unset: none."""
    every: int = option(0, ge=0, name="checkpoint-every",
                        not_flat="groups checkpoint at the end of rounds: checkpoint-rounds")
    """Checkpoint every N steps (and at the end); 0: only at the end (when `checkpoint-dir` is set)."""
    keep: int = option(2, ge=1, name="keep-checkpoints")
    """Complete checkpoints kept per group; older ones are deleted once a newer one is complete."""
    async_save: bool = option(False, name="async-checkpoint",
                               not_flat="a group commits its round's checkpoint before it replies")
    """Write checkpoints in a background thread; the commit (rename) happens at the next save or at the end."""
    resume: bool = False
    """Continue from the newest complete checkpoint in `checkpoint-dir` (model, optimizer, schedule, data, RNG); a
    damaged or incomplete newest one is skipped (logged) for the one before."""


@dataclass
class OutputConfig:
    """What a run leaves behind: one run directory with its configuration, metrics, summary and model."""

    run_dir: str | None = None
    """The run directory; unset: `outputs/<date>_<time>` under the working directory (a Flower run: the ServerApp's,
    which is the SuperLink's, and `-run<run id>` added). It holds config.json, metrics.jsonl, summary.json, model/
    and tensorboard/."""
    save_model: bool = True
    """Write the final model in Hugging Face format to `<run-dir>/model` (`from_pretrained` loads it); each rank
    writes its own rows, no rank gathers the model."""
    save_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the saved model's tensors."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to `<run-dir>/tensorboard` (needs the `tensorboard` extra)."""
    wandb_project: str | None = None
    """Also log metrics to this Weights & Biases project (needs the `wandb` extra; WANDB_MODE=offline works)."""
    log_every: int = option(10, ge=1)
    """Log a line (loss, perplexity, tokens/s, memory, MFU) and a metrics record every N steps."""
    progress: bool = option(True, not_flat="groups write progress lines to their log instead (log-every)")
    """Show a progress bar on rank 0."""
    peak_tflops: float | None = option(None, gt=0)
    """Peak dense TFLOP/s of one device in the compute dtype, for the MFU estimate; unset: known GPUs' figures
    (none for CPUs, whose MFU is then not reported)."""


@dataclass
class TrainConfig:
    """A whole training run: parallel layout, model, data, optimizer, checkpoints, outputs and loop settings."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Process layout and shard sync."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and sharding policy."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Sharded checkpoints and resume."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Run directory, logging and model export."""
    steps: int = option(200, ge=1, not_flat="derived: num-server-rounds x syncs-per-round x aggregate-every")
    """Optimizer steps per rank."""
    batch_size: int = option(8, ge=1)
    """Sequences per rank per micro-batch."""
    grad_accum: int = option(1, ge=1)
    """Micro-batches accumulated per optimizer step."""
    seed: int = 42
    """Seed for model init, data order and partitioning."""
    eval_every: int = option(50, ge=0, not_flat="a Flower run evaluates at the end of every round")
    """Evaluate held-out perplexity every N steps (and at the end); 0: only at the end."""
    timeout_s: float = option(600.0, gt=0, name="timeout",
                               not_flat="a group's own collective timeout is set when it starts (--collective-timeout)")
    """Timeout of every collective, in seconds."""


def option_table() -> dict[str, schema.Option]:
    """Flat name -> option of a TrainConfig (the static engine's command line)."""
    return schema.by_name(TrainConfig)


def label_of(surface: Surface, name: str) -> str:
    """How `surface` names the TrainConfig option `name`."""
    return surface.label(option_table()[name])


_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)")


def respelled(exc: ConfigError, surface: Surface) -> ConfigError:
    """`exc`, a check's message naming command-line flags (`--model: ...`), with each TrainConfig option as `surface`
    spells it (`run config 'model': ...`); text in backticks, a command to type, keeps its flags."""
    table = option_table()

    def label(match: re.Match[str]) -> str:
        o = table.get(match.group(1))
        return surface.label(o) if o is not None else match.group(0)

    parts = str(exc).split("`")
    return surface.error("`".join(_FLAG.sub(label, p) if i % 2 == 0 else p for i, p in enumerate(parts)))


# ----------------------------------------------------------------------------------------------------- loading

def load_config(path: str | Path) -> TrainConfig:
    """Read a YAML file laid out like `config_to_dict` (sections as mappings)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from None
    return schema.from_nested(TrainConfig, data, schema.yaml_surface(str(path)))


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build a TrainConfig from a nested dict (the YAML/JSON layout), rejecting unknown keys and wrong types."""
    return schema.from_nested(TrainConfig, raw, schema.yaml_surface("config"))


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return schema.to_nested(cfg)


# ----------------------------------------------------------------------------------------------------- checks

def labeler(surface: Surface):
    """`L(name)`: the TrainConfig option `name` as `surface` spells it."""
    return lambda name: label_of(surface, name)
