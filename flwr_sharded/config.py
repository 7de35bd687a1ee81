"""Typed run configuration: one dataclass per concern, the one declaration of every training option (its docstring
documents it: `flwr_sharded.schema`), and its YAML files; the checks that span options are `flwr_sharded.validation`.
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
from flwr_sharded.parallel.rules import RULES, rule_options
from flwr_sharded.parallel.plausibility import DEFAULT_MAX_MOVE
from flwr_sharded.parallel.sparse import CHUNK, DEFAULT_ERROR_DECAY, DEFAULT_MERGE, TopkMerge
from flwr_sharded.parallel.wire import QUANT_BLOCK, QUANTIZED, SyncDtype, described
from flwr_sharded.presets import PRESETS
from flwr_sharded.schema import Surface, option

Method = Literal["fsdp", "hsdp", "fl-fsdp", "fl-hsdp"]
METHODS: tuple[str, ...] = typing.get_args(Method)


_LRS, _MOMENTA = ({name: rule_options(cls)[key] for name, cls in RULES.items() if key in rule_options(cls)}
                  for key in ("lr", "momentum"))
"""The built-in outer rules that take an outer learning rate, an outer momentum, with their defaults."""
_NONLINEAR = [name for name, cls in RULES.items() if not cls.linear]


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
    """S of each federation group, comma-separated (e.g. 2,4): groups that shard differently (FL methods), averaged
    piece by piece where their shards overlap; F is their number, the world R x their sum. Unset: F x `shards`."""
    aggregate_every: int = option(8, ge=1)
    """A: optimizer steps between two shard syncs (FL methods only)."""
    group_steps: Literal["equal", "speed"] = "equal"
    """Local steps each federation group trains per sync: equal (A each), or speed (the fastest group A, one k times
    slower about A/k, at least 1), so that groups of different speeds arrive at the sync together, by the step times
    of the last sync (a Flower round: each member's last reply; equal until all have one). Weights stay the tokens
    trained; schedules, logging, evaluation and the end of run follow the fastest group. Each group's idle time per
    sync is recorded either way (`sync_groups` records; a Flower round's `idle_s_per_sync`)."""
    bucket_mb: float = option(64.0, gt=0)
    """Size of one flat buffer used by the shard sync, in MiB; one collective per bucket."""
    sync_dtype: SyncDtype = option("float32", facts={"wires": described(), "block": str(QUANT_BLOCK),
                                                      "nonlinear": " or ".join(_NONLINEAR)})
    """Wire dtype of the cross-group all-reduce: float32 sends the shards, the others each group's weighted delta from
    the last global model (the outer gradient, as DiLoCo does), so only that delta is rounded, summed in fp32. Each
    with its bytes over float32's: {wires}. The quantized ones carry one fp32 scale per {block} values. All but
    float32 cost one fp32 copy of the rank's shards for fedavg (outer optimizers keep one already) and need a linear
    outer rule (not {nonlinear})."""
    sync_error_feedback: bool = option(False, facts={"quantized": ", ".join(QUANTIZED)})
    """With a quantized `sync-dtype` ({quantized}) or `sync-topk`: carry each rank's rounding errors (and what top-k
    did not send) into its next sync, so they do not accumulate over syncs; one more fp32 copy of the rank's shards."""
    sync_topk: float | None = option(None, gt=0, le=1, facts={"chunk": str(CHUNK)})
    """Send only this fraction (e.g. 0.015625, SparseLoCo's 64 of 4096) of each rank's delta plus its decayed
    residual (`sync-error-decay`), the largest entries of each chunk of {chunk} values, as rows of 12-bit indices and
    values in the `sync-dtype` format (int2: 2-bit codes through a 4-bin codebook), all-gathered and merged on every
    rank (`sync-topk-merge`, SparseLoCo): about W x fraction x (1.5 + value bytes) / 8 of the fp32 all-reduce's bytes
    over W groups (at 1.5625% with int2: 0.0069x for 2 groups, 0.014x for 4). Needs `sync-error-feedback` (the
    residual keeps what is not sent) and a linear outer rule; one fp32 copy of the shards for fedavg, as a reduced
    wire. Unset: dense."""
    sync_topk_merge: TopkMerge = DEFAULT_MERGE
    """How every rank merges the members' top-k rows (`sync-topk` only): scatter-mean (SparseLoCo's, as Templar
    deploys it) moves each coordinate by the weighted mean of what the members that sent it sent, each member's row
    first scaled down to the median of the members' row norms, so that a coordinate few members sent is not shrunk
    and one outsized member cannot dominate; sum adds every member's weighted row (with `sync-error-decay` 1: the
    top-k sync before scatter-mean)."""
    sync_error_decay: float = option(DEFAULT_ERROR_DECAY, gt=0, le=1)
    """The top-k residual's decay (SparseLoCo's beta, `sync-topk` only): before each selection the residual becomes
    decay x itself + the delta, and only what was sent, as decoded, leaves it. A dense quantized wire's residual
    (`sync-error-feedback`) carries its rounding errors whole."""
    sync_sites: str = option("", not_flat="a Flower run's sites are its facilities (`facilities`, or each "
                                          "SuperNode's node config `facility`), decided for each round's members")
    """The site of each federation group, comma-separated (e.g. a,a,b,b): groups at one site share a fast network
    behind one slow uplink. A linear sync then reduces inside each site first, crosses the slow tier once with each
    member carrying 1/L of its shard on its own uplink (L groups per site; a quantized `sync-dtype` rounds only
    there), and gathers inside the site: 2(G-1)/G x S/L bytes per member across sites instead of the flat ring's
    2(P-1)/P x S. A `sync-topk` sync selects each member's share of its site's sum and all-gathers that row across
    sites. Every site must hold as many groups; groups that shard alike, not `sync-restart residual`. Unset, one
    site, or one group per site: the flat ring."""
    sync_fragments: int = option(1, ge=1)
    """N: sync the model in N fragments of contiguous transformer blocks (Streaming DiLoCo), fragment i after step
    round((i + 1) A / N) of each period, so the link carries about 1/N of the model at a time, each fragment with its
    own outer-rule state; at most one fragment per block and per step of the period."""
    sync_delay: int = option(0, ge=0)
    """tau: start each fragment's sync tau steps before it is merged and reduce it in the background meanwhile
    (overlap); the arriving global values are then mixed into the local ones (`sync-alpha`). Smaller than the fewest
    steps between two fragments' syncs; 0: the sync blocks training."""
    sync_alpha: float = option(0.0, ge=0, le=1)
    """alpha: when a sync is merged, every shard becomes alpha * local + (1 - alpha) * global (Streaming DiLoCo's
    mixing; 0 adopts the global values, discarding the local steps taken while the sync travelled)."""
    sync_carry: bool | None = None
    """Keep the local steps taken while an overlapped sync travelled (unset: on when `sync-delay` > 0; off:
    `--no-sync-carry`, or `false`): a merge mixes in global + (local - snapshot), so a shard becomes local + (1 -
    alpha) * (global - snapshot). One more copy of the largest fragment's shards; an error with `sync-delay` 0."""
    sync_dense_warmup: int = option(0, ge=0)
    """With `sync-topk`: the syncs of the first this many periods send every entry through the `sync-dtype` wire
    (a dense ring), as Deep Gradient Compression and PowerSGD warm up, since early errors are not recovered; what
    top-k held back and the dense wire's rounding errors share one residual."""
    sync_dense_flush: bool = option(False, not_flat="a Flower run's last round is the server's to know; the static "
                                                    "engine's last step is its own")
    """With `sync-topk`: the run's last sync (the static engine's last period) sends every entry through the
    `sync-dtype` wire, so what top-k held back in the residual reaches the final model."""
    sync_restart: Literal["global", "residual"] = option("global", not_flat="groups then differ between syncs, "
                                                                           "where a Flower round compares them")
    """Where each group goes on from after a top-k sync: the global model (SparseLoCo), or the global model plus its
    own residual (what it did not send), which then travels in its shards instead of the error-feedback buffer (with
    `sync-error-decay` 1 nothing of it is lost). The groups then differ between syncs while their global models (kept
    for the next delta) agree; a rollback restores both. The static engine only."""
    reset_optimizer_state: bool = False
    """Clear the inner optimizer's state (e.g. Adam moments) after each sync; by default it stays local and kept."""
    sync: bool = option(True, not_flat="a Flower run always syncs; the no-sync limit is a static-engine benchmark")
    """Run the shard sync of FL methods; off gives the no-sync limit (independent groups), for benchmarks."""
    sync_retries: int = option(3, ge=0, not_flat="a Flower round ends at a failed sync, every member rolled back; "
                                                 "the strategy's strikes decide what follows (max-strikes)")
    """Static engine: a sync that fails on any member (an error, a timeout, a rejected result) puts every rank back at
    the last adopted sync (shards, outer state, inner optimizer, step, schedule) and training goes on with fresh
    batches, at most this many times in a row. 0: stop at the first, keeping no rollback copy in host memory. On
    gloo a failed collective (a timeout, a lost peer) makes the federation's groups anew, every rank waiting up to
    --timeout for the others (a member stopped for longer stops the run). On NCCL a rejected result (not finite,
    implausible, a lying member) is retried like on gloo, but a failed collective
    (a timeout, a lost peer) aborts communicators the static engine cannot rebuild: the run stops with the error
    (continue it with --resume from its last checkpoint; a Flower round rebuilds its groups instead)."""
    sync_max_move: float = option(DEFAULT_MAX_MOVE, ge=0)
    """Adopt a sync only if, on every rank, the result moves each bucket of its shards by at most this many times the
    median of that bucket's recent adopted moves, per token of the rank's weight (at first: this many times the
    bucket's norm), so that a member sending absurd values cannot poison the model (docs/security.md); a rejected
    sync is rolled back everywhere and the member whose values alone explain it is named (struck, in a Flower run).
    An overlapped sync keeps one more copy of the largest fragment's shards for it. 0: only finiteness is checked, and
    nobody is named."""
    outer: str = option("fedavg", facts={"rules": ", ".join(RULES), "nonlinear": " and ".join(_NONLINEAR)})
    """How synced shards are combined: {rules}, or a `package.module:Class` ShardRule (nesterov is DiLoCo's).
    {nonlinear} ignore the weights and all-gather every group's shards (F/2 x the bytes of the others' all-reduce;
    docs/custom-rules.md); a Flower run's server path has its own: `server-rule`."""
    outer_lr: float | None = option(None, gt=0, facts={"defaults": ", ".join(f"{n} {v}" for n, v in _LRS.items())})
    """Outer learning rate; unset: the rule's default ({defaults})."""
    outer_momentum: float | None = option(None, ge=0, lt=1, facts={
        "rules": " and ".join(_MOMENTA), "default": "/".join(sorted({str(m) for m in _MOMENTA.values()}))})
    """Outer momentum of {rules}; unset: {default}."""
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
        """Each federation group's S, in group order: `group-shards` (checked by `validation.validate_parallel`), else
        F groups of `shards`."""
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
            " with error feedback" if self.sync_error_feedback else "") + (
            f" ({self.sync_topk_merge}, decay {self.sync_error_decay:g})" if self.sync_topk else "")
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

    name: str = option("small", name="model", facts={"presets": ", ".join(PRESETS)})
    """A preset ({presets}), a Hugging Face model id, or a local model directory. A hub id or directory brings its own
    tokenizer unless `tokenizer` is set; presets use the tokenizer in `data-dir`."""
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
    file (gzipped json too), a directory of them (`train*` / `*validation*` name the splits), or a copy of a hub
    dataset repository. Script-based hub datasets: their Parquet conversion (`dataset-revision`) or their files."""
    data_dir: str | None = None
    """Directory holding the prepared corpus, tokenizer and token caches (`flwr-sharded prepare-data`); unset:
    `$FLWR_SHARDED_DATA`, else ~/.cache/flwr_sharded."""
    tokenizer: str | None = None
    """Tokenizer id or path, with no more tokens than the model's embedding; unset: the model's own for a hub id or
    local directory, else (presets) the byte-level BPE of the embedded corpus in `data-dir`."""
    dataset_config: str | None = None
    """Configuration (subset) of a hub dataset, e.g. `ita_Latn` for HuggingFaceFW/fineweb-2: its directory with
    `dataset-revision refs/convert/parquet` or in a local repository copy without a README."""
    dataset_revision: str | None = None
    """Git revision (branch, tag or commit) of a hub dataset; pin a commit for reproducible runs, or use
    `refs/convert/parquet`, the Hub's Parquet conversion (of script-based datasets among others); unset: main."""
    streaming: bool = False
    """Read the dataset as a stream instead of downloading it whole (corpora that do not fit on disk), until
    `max-train-blocks` blocks are full (required). Validation: the `validation` split, else the first documents
    until `eval-blocks` blocks are full, training starting at the next one."""
    tokenize_workers: int | None = option(None, ge=1)
    """Processes that tokenize a map-style dataset, with the same blocks for any number; unset: min(8, CPUs); at most
    one per 1,000 documents (a small corpus is tokenized in the rank's own process). One rank per data directory
    tokenizes, the others wait for its cache."""
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
    """FedProx: add mu/2 * ||w - w_sync||^2 to each group's objective, w_sync its shards after the last sync; 0 turns
    it off. FL methods only."""


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
    """Continue from the newest complete checkpoint in `checkpoint-dir` (model, optimizer, schedule, data, RNG),
    skipping (logged) a damaged or incomplete one."""


@dataclass
class OutputConfig:
    """What a run leaves behind: one run directory with its configuration, metrics, summary and model."""

    run_dir: str | None = None
    """The run directory (config.json, metrics.jsonl, summary.json, model/, tensorboard/); unset:
    `outputs/<date>_<time>` under the working directory (a Flower run: the ServerApp's, with `-run<run id>`)."""
    save_model: bool = True
    """Write the final model in Hugging Face format to `<run-dir>/model`, each rank its own rows."""
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
    """Peak dense TFLOP/s of one device in the compute dtype, for the MFU estimate; unset: known GPUs' (no MFU on
    CPUs)."""


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
    """Timeout of every collective, in seconds: every process group the run makes has it, and a sync's collectives
    raise when it runs out."""


def label_of(surface: Surface, name: str) -> str:
    """How `surface` names the TrainConfig option `name`."""
    return surface.label(schema.by_name(TrainConfig)[name])


_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)")


def respelled(exc: ConfigError, surface: Surface) -> ConfigError:
    """`exc`, a check's message naming command-line flags (`--model: ...`), with each TrainConfig option as `surface`
    spells it (`run config 'model': ...`); text in backticks, a command to type, keeps its flags."""
    table = schema.by_name(TrainConfig)

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


def labeler(surface: Surface):
    """`L(name)`: the TrainConfig option `name` as `surface` spells it."""
    return lambda name: label_of(surface, name)
