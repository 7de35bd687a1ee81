"""The options of `flwr-sharded bench` and its `exec`, `check` and `sync` sub-commands, one field each; a training
option of the runs is the trainer's own (`same_as`), with the benchmark's default where it differs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Literal

from flwr_sharded import schema, tool_options
from flwr_sharded.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES, SyncDtype
from flwr_sharded_perf.bench.runs import UNEQUAL_RUNS, VARIANT_RUNS, variant_wire
from flwr_sharded_perf.plan_cli import PlanOptions
from flwr_sharded_perf.provenance import REPO
from flwr_sharded.schema import option, same_as

RUN_KEYS = ("fsdp", "hsdp", "fl-fsdp", "fl-hsdp", "no-sync",
            *(k for k in VARIANT_RUNS if variant_wire(k) in (None, "topk", *SYNC_DTYPE_BYTES)))
"""The runs the benchmark can do: the four methods, the no-sync limit and FL+FSDP with the other syncs whose wire the
trainer has (`--sync-dtype`)."""


@dataclass
class OverlapOptions:
    """The trainer's sync options as the overlapped runs (fl-fsdp-overlap, fl-fsdp-overlap-int8) set them."""

    sync_fragments: int = same_as(ParallelConfig, "sync_fragments", default=2)
    sync_delay: int = same_as(ParallelConfig, "sync_delay", default=3)
    sync_alpha: float = same_as(ParallelConfig, "sync_alpha")
    sync_carry: bool = same_as(ParallelConfig, "sync_carry", default=True)


@dataclass
class BenchOptions:
    """`flwr-sharded bench`: the clusters, the runs and their training options, the sweep, outputs and timeouts."""

    cluster: str = str(REPO / "examples" / "clusters" / "emulated.yaml")
    """Cluster YAML to emulate."""
    contrast: str = str(REPO / "benchmarks" / "clusters" / "emulated-flat.yaml")
    """A contrasting cluster for the planner check; `none` skips it."""
    layouts: str | None = None
    """Layouts of the main cluster instead of the default ones, e.g. fsdp=1x1x8,fl-fsdp=4x1x2 (F x R x S)."""
    methods: str = ",".join(RUN_KEYS)
    """Runs to do, comma-separated, among fsdp, hsdp, fl-fsdp, fl-hsdp, no-sync and the FL+FSDP variants
    fl-fsdp-flat (the flat ring where the cluster's sites make the other FL runs two-level), fl-fsdp-overlap,
    fl-fsdp-int8, fl-fsdp-overlap-int8, fl-fsdp-overlap-int8-flat (flat ring), fl-fsdp-int4, fl-fsdp-overlap-int4,
    fl-fsdp-int2, fl-fsdp-overlap-int2 (where the trainer has the int2 wire), fl-fsdp-topk and fl-fsdp-overlap-topk;
    `none` skips the main cluster's scenario (e.g. for the unequal one alone)."""
    model: str = same_as(ModelConfig, "name")
    """Model preset of every run (its traffic is predicted from the preset)."""
    seq_len: int = same_as(DataConfig, "seq_len", default=64)
    batch_size: int = same_as(TrainConfig, "batch_size", default=1)
    steps: int = same_as(TrainConfig, "steps", default=32)
    repeats: int = option(1, ge=1)
    """Runs of each method on the main cluster, interleaved."""
    sites: Literal["cluster", "flat"] = "cluster"
    """How the FL runs sync where the cluster's groups are sites (the nodes behind one `inter_group` uplink): in two
    levels by them (`--sync-sites`), or the flat ring over every member (fl-fsdp-flat always runs the flat ring)."""
    variant_steps: int | None = option(None, ge=1)
    """Steps of the no-sync and sync-variant runs of the main scenario (unset: `steps`): more than the blocking
    reference's let a faster sync reach the reference's final perplexity later in steps but sooner in time (the
    time-to-target table)."""
    contrast_steps: int = option(32, ge=1)
    """Optimizer steps per run on the contrasting cluster."""
    contrast_repeats: int = option(1, ge=1)
    """Runs of each method on the contrasting cluster, interleaved."""
    contrast_batch_size: int = option(4, ge=1)
    """Sequences per rank per step on the contrasting cluster (compute-heavy, so communication is a small part of a
    step)."""
    unequal: str = str(REPO / "benchmarks" / "clusters" / "emulated-unequal.yaml")
    """Cluster YAML of the unequal scenario (a federation of groups that shard differently next to an equal one);
    `none` skips it."""
    unequal_groups: str = "2,4"
    """S of each group of the unequal federation (R = 1, the trainer's --group-shards); the equal federation next to
    it has as many groups of their mean S (2,4: 2 groups of 3)."""
    unequal_runs: str = ",".join(UNEQUAL_RUNS)
    """Runs of the unequal scenario, comma-separated, among equal, unequal, unequal-slow (one group slowed down,
    equal local steps per sync) and unequal-slow-speed (the same with the trainer's --group-steps speed)."""
    slow_group: int = option(1, ge=0)
    """The group the slow runs slow down (`flwr_sharded_perf.bench.slow_train`)."""
    slow_seconds: float | None = option(None, gt=0)
    """Seconds the slow group sleeps after each optimizer step; unset: that group's mean step time in the unequal run
    (it is then about half as fast)."""
    aggregate_every: int = same_as(ParallelConfig, "aggregate_every")
    sync_dtype: SyncDtype = same_as(ParallelConfig, "sync_dtype")
    sync_topk: float = same_as(ParallelConfig, "sync_topk", default=0.01)
    """The fraction of each chunk's delta the top-k runs send (fl-fsdp-topk, fl-fsdp-overlap-topk: int2 codebook
    values, error feedback without decay, each group restarting from the global model plus its residual, a dense
    flush at the end)."""
    overlap: OverlapOptions = field(default_factory=OverlapOptions)
    """The trainer's sync options as the overlapped runs set them (the other FL runs sync in one fragment, blocking)."""
    sweep: str = "1,2,4,8,16,32"
    """Values of A for the FL+FSDP sweep, comma-separated; `none` skips the sweep."""
    sweep_windows: int = option(1, ge=1)
    """Measured windows of max(A, 8) steps per sweep point, after a warm-up window."""
    lr: float = same_as(OptimConfig, "lr", default=1e-3)
    seed: int = same_as(TrainConfig, "seed")
    eval_every: int = same_as(TrainConfig, "eval_every", default=16)
    """Evaluate held-out perplexity every N steps (and at the end; 0: only at the end), the points the time-to-target
    table interpolates between, so it needs N <= A (e.g. 8 with A = 8) for a curve."""
    eval_blocks: int = same_as(DataConfig, "eval_blocks", default=32)
    fl_margin: float = same_as(PlanOptions, "fl_margin")
    measure_planner_choice: bool = option(True, name="planner-run")
    """Also measure the planner's first choice when it is not among the measured layouts."""
    data_dir: str | None = same_as(DataConfig, "data_dir")
    out: str = "bench-results"
    """Output directory (bench.json, bench.md, PNGs)."""
    keep_runs: str | None = None
    """Keep each run's metrics, traffic and logs in this directory."""
    date: str | None = None
    """Date printed in the report; unset: today."""
    quick: bool = False
    """Tiny model, 8 steps, A = 2, no sweep, no contrast, no planner run, no unequal scenario unless it is all there
    is to run (`--methods none`) (for tests)."""
    run_timeout: float = option(1200.0, gt=0)
    """Seconds one training run may take."""
    collective_timeout: float = same_as(TrainConfig, "timeout_s", name="collective-timeout", default=300.0)
    timeout: float = option(3600.0, gt=0)
    """Seconds the whole benchmark may take."""


@dataclass
class ExecOptions:
    """`flwr-sharded bench exec`: a command once per rank on the emulated cluster."""

    cluster: str | None = option(None, required=True)
    """Cluster YAML to emulate."""
    nproc: int | None = option(None, ge=1)
    """Ranks to start; unset: all of the cluster's."""
    log_dir: str | None = None
    """Keep each rank's stdout and stderr in this directory."""


@dataclass
class LinkCheckOptions:
    """`flwr-sharded bench check`: the emulated links' throughput against their description."""

    cluster: str | None = option(None, required=True)
    """Cluster YAML to emulate."""
    seconds: float = option(0.5, gt=0)
    """Target duration of each transfer."""
    json: bool = False
    """Print JSON."""


@dataclass
class SyncOptions:
    """`flwr-sharded bench sync`: benchmarks/sync_bench.py on loopback and across shaped inter-group links."""

    federations: int = same_as(ParallelConfig, "federations", default=2)
    shards: int = same_as(ParallelConfig, "shards")
    bandwidths: str = "100Mbit,1Gbit"
    """Inter-group bandwidths, comma-separated."""
    layers: int = option(16, ge=1)
    """Layers of sync_bench.py's model."""
    hidden: int = option(64, ge=1)
    """Width of sync_bench.py's model."""
    repeats: int = option(20, ge=1)
    """Syncs timed per bandwidth."""
    sync_out: str = "benchmarks/results"
    """Directory for the JSON files."""


def _leaves(obj: Any) -> dict[str, Any]:
    """Field name -> value of every option of `obj` (sections flattened)."""
    return {o.path[-1]: schema.get(obj, o.path) for o in schema.options(obj)}


def resolve_bench(parsed: argparse.Namespace, sub: type | None = None) -> argparse.Namespace:
    """The flat namespace the benchmark's modules read, from a parsed command line (lists parsed, `none` unset;
    `sub`: a sub-command's options, which win over the benchmark's); ConfigError naming the flag."""
    bench = schema.apply_arguments(BenchOptions(), parsed)
    values = _leaves(bench)
    skip_sweep = bench.sweep.lower() in ("none", "")
    skip_main = bench.methods.lower() == "none"
    values.update(method_list=[] if skip_main else tool_options.split_list(bench.methods, "--methods",
                                                                            allowed=RUN_KEYS),
                  sweep_values=[] if skip_sweep else tool_options.split_list(bench.sweep, "--sweep", int),
                  contrast=None if bench.contrast.lower() in ("none", "") else bench.contrast,
                  unequal=None if bench.unequal.lower() in ("none", "") else bench.unequal,
                  unequal_run_list=tool_options.split_list(bench.unequal_runs, "--unequal-runs",
                                                           allowed=UNEQUAL_RUNS))
    if sub is not None:
        values.update(_leaves(schema.apply_arguments(sub(), parsed)))
    if sub is SyncOptions:
        from flwr_sharded_perf.cluster import parse_bandwidth

        values["bandwidth_values"] = [parse_bandwidth(x, "--bandwidths")
                                      for x in tool_options.split_list(values["bandwidths"], "--bandwidths")]
    return argparse.Namespace(**values)

