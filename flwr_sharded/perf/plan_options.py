"""The options of `flwr-sharded plan`, one field each: the cluster, the model, the step and what to print.

The trainer's options that decide a rank's memory are the trainer's own (`same_as` a field of
`flwr_sharded.config`), with their defaults; `flwr_sharded.perf.memory_model.StepOptions` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flwr_sharded.config import METHODS, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from flwr_sharded.parallel.wire import SyncDtype
from flwr_sharded.schema import option, same_as


@dataclass
class PlanOptions:
    """`flwr-sharded plan`: rank every (method, F, R, S, A) layout of a cluster with the cost model."""

    cluster: str | None = option(None, required=True)
    """Cluster YAML (see examples/clusters/); one that lists `facilities` plans a federation of facilities of different
    sizes: each facility's R and S, its local steps per sync and its idle time."""
    model: str | None = None
    """A model as `train --model` takes it: a preset (tiny, small, medium, llama-1b, llama-3b, llama3.1-8b), a Hugging
    Face model directory or hub id (its architecture read from config.json); or a model without either: `params`
    and `layers`."""
    params: float | None = option(None, gt=0)
    """Parameter count of a model without preset, e.g. 8e9 (with `layers`)."""
    layers: int | None = option(None, ge=1)
    """Transformer blocks of that model (with `params`)."""
    hidden_size: int | None = option(None, ge=1)
    """Width of that model, for the activation estimate (with `params`)."""
    vocab_size: int = option(32000, ge=1)
    """Vocabulary of a preset without one, and of a model without preset."""
    bytes_per_param: float = option(2.0, gt=0)
    """Bytes per parameter on the wire and in compute (2: bf16, 4: fp32)."""
    sync_dtype: SyncDtype | None = same_as(ParallelConfig, "sync_dtype", default=None)
    """Wire dtype of the FL shard sync's all-reduce (`flwr-sharded train --sync-dtype`): its bytes are parameters x
    the dtype's size; unset: `bytes-per-param`, like the other collectives."""
    sync_topk: float | None = same_as(ParallelConfig, "sync_topk")
    """The FL shard sync's top-k fraction (`flwr-sharded train --sync-topk`): its rows, all-gathered, instead of the
    all-reduce (their bytes grow with F); unset: dense."""
    state_bytes_per_param: float | None = option(None, gt=0)
    """Bytes per parameter of parameters + gradients + optimizer state together; unset: the trainer's (fp32 weights,
    gradients and AdamW moments: 16)."""
    optimizer: Literal["adamw", "sgd"] = same_as(OptimConfig, "optimizer")
    outer: str = same_as(ParallelConfig, "outer")
    bucket_mb: float = same_as(ParallelConfig, "bucket_mb")
    grad_accum: int = same_as(TrainConfig, "grad_accum")
    reshard_after_forward: bool = same_as(ModelConfig, "reshard_after_forward")
    activation_checkpointing: bool = same_as(ModelConfig, "activation_checkpointing")
    tokens_per_gpu: int = option(2 * 2048, ge=1)
    """Tokens per GPU per optimizer step (the paper's 2 x 2048), split over `grad-accum` micro-batches."""
    aggregate_every: str = "1,2,4,8,16,32"
    """Values of A to try for FL methods, comma-separated (for a federation of facilities: the fastest one's)."""
    methods: str = ",".join(METHODS)
    """Methods to consider, comma-separated."""
    top: int = option(10, ge=1)
    """Rows to print."""
    sizes: Literal["exact", "paper"] = "exact"
    """Message sizes: each collective's own (exact) or one M for all, as the paper's Eqs. 1-5 (paper)."""
    latency: bool = False
    """Add the cluster's per-tier latency per ring step (a cluster with a `calibration` always counts it)."""
    memory_fraction: float = option(0.9, gt=0, le=1)
    """Usable share of a GPU's memory."""
    fl_margin: float = option(0.1, ge=0)
    """FL must be this fraction faster than a synchronous method to rank above it."""
    layouts: Literal["paper"] | None = None
    """`paper`: instead of planning, predict the paper's four 512-GPU layouts next to its Table 4."""
    json: bool = False
    """Print JSON instead of a table."""
