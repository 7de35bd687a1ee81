"""Rank (method, F, R, S, A) layouts for a cluster description with the cost model; the `plan` sub-command.

Every candidate uses all GPUs of the cluster (F x R x S = GPUs), places ranks shard-innermost (rank = f*R*S + r*S +
s, nodes filled in order, node groups filled in order), takes for each mesh dimension the bandwidth of the slowest
tier its groups span, and predicts one optimizer step as compute + communication (no overlap, as the paper's model).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from flwr_sharded.config import METHODS, SYNC_DTYPE_BYTES

from flwr_sharded.errors import ConfigError
from flwr_sharded.perf.costmodel import (
    BACKENDS,
    DIMENSIONS,
    TIERS,
    CommTerms,
    MemoryEstimate,
    ModelShape,
    Placement,
    check_layout,
    comm_terms,
    compute_time,
    memory_per_gpu,
)
from flwr_sharded.training.models import PRESETS

GiB = 1024**3

# ---------------------------------------------------------------------------------------------------------------------
# Cluster description.


@dataclass(frozen=True)
class Cluster:
    """A GPU cluster with a three-tier network: inside a node, between nodes of a group, between groups."""

    name: str
    """Label for reports."""
    gpus_per_node: int
    """GPUs (ranks) per node."""
    nodes: int
    """Nodes used."""
    nodes_per_group: int | None
    """Nodes per rack / cell / facility; None: all nodes in one group (no inter-group tier)."""
    bandwidth: dict[str, float]
    """Bandwidth per tier (intra_node, inter_node, inter_group) one flow of a ring collective gets, bits/s."""
    latency: dict[str, float]
    """Start-up latency per tier, seconds; used only by the planner's optional alpha term (0 if not given)."""
    gpu_memory: float
    """Bytes of memory per GPU."""
    flops_per_gpu: float
    """Achievable (not peak) FLOP/s per GPU for training."""
    backend: str = "nccl"
    """Collective library: nccl, or gloo (whose reduce-scatter costs an all-reduce)."""
    shared: tuple[str, ...] = ()
    """Tiers whose bandwidth is one uplink per node (inter_node) or per node group (inter_group), divided among the
    flows leaving it at once (e.g. tbf-shaped links); other tiers give every flow their full bandwidth."""

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def placement(self, F: int, R: int, S: int) -> Placement:
        """Placement of an F x R x S mesh on this cluster."""
        return Placement(F=F, R=R, S=S, gpus_per_node=self.gpus_per_node, nodes_per_group=self.nodes_per_group)


_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_BANDWIDTH = re.compile(rf"^{_NUMBER}\s*([kKMGT]?)(bit|bits|b|B|byte|bytes)(?:/s|ps)?$")
_MEMORY = re.compile(rf"^{_NUMBER}\s*([kKMGT]i?)?(B|bytes?)$")
_LATENCY = re.compile(rf"^{_NUMBER}\s*(s|ms|us|µs|ns)$")
_FLOPS = re.compile(rf"^{_NUMBER}\s*([kKMGTP]?)(?:FLOPS|FLOP/s|flops)?$")
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _parse(value: Any, field: str, pattern: re.Pattern, scale: Any, example: str, allow_zero: bool = False) -> float:
    """A number, or a string matched by `pattern` whose groups `scale(match)` turns into the unit's multiplier."""
    amount = _number(value)
    if amount is None and isinstance(value, str):
        m = pattern.match(value.strip())
        if m:
            amount = float(m.group(1)) * scale(m)
    if amount is None or not math.isfinite(amount) or amount < 0 or (amount == 0 and not allow_zero):
        raise ConfigError(f"{field}: expected {example}, got {value!r}")
    return amount


def parse_bandwidth(value: Any, field: str = "bandwidth") -> float:
    """Bits/s from a number (bits/s) or a string: '200Gbit', '7.5Gbit/s', '100Mbps', '25GB/s' (bytes: x 8)."""
    return _parse(value, field, _BANDWIDTH, lambda m: _PREFIX[m.group(2)] * (8 if m.group(3).startswith("B") else 1),
                  "a positive bandwidth such as '200Gbit', '100Mbit/s', '25GB/s' or a number of bits/s")


def parse_memory(value: Any, field: str = "gpu_memory") -> float:
    """Bytes from a number or a string: '64GB' (decimal, 64e9), '64GiB' (binary)."""
    return _parse(value, field, _MEMORY, lambda m: _PREFIX[m.group(2) or ""],
                  "a positive size such as '64GB', '80GiB' or a number of bytes")


def parse_latency(value: Any, field: str = "latency") -> float:
    """Seconds from a number or a string: '5us', '2ms', '1e-6s'."""
    return _parse(value, field, _LATENCY, lambda m: _SECONDS[m.group(2)],
                  "a latency >= 0 such as '5us', '2ms' or a number of seconds", allow_zero=True)


def parse_flops(value: Any, field: str = "flops_per_gpu") -> float:
    """FLOP/s from a number or a string: '150T', '150TFLOPS', '5GFLOP/s'."""
    return _parse(value, field, _FLOPS, lambda m: _PREFIX[m.group(2)],
                  "a positive rate such as '150TFLOPS' or a number of FLOP/s")


def _count(data: dict, key: str, where: str, required: bool = True) -> int | None:
    value = data.get(key)
    if value is None:
        if required:
            raise ConfigError(f"{where}: missing field '{key}' (a positive integer)")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: field '{key}' must be a positive integer, got {value!r}")
    return value


_CLUSTER_KEYS = {"name", "description", "gpus_per_node", "nodes", "nodes_per_group", "bandwidth", "latency",
                 "gpu_memory", "flops_per_gpu", "backend", "shared"}
_SHAREABLE = ("inter_node", "inter_group")


def cluster_from_dict(data: Any, where: str = "cluster") -> Cluster:
    """Validate a cluster description (the YAML's mapping); ConfigError names the offending field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of cluster fields, got {type(data).__name__}")
    unknown = sorted(set(data) - _CLUSTER_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_CLUSTER_KEYS))}")
    gpus_per_node = _count(data, "gpus_per_node", where)
    nodes = _count(data, "nodes", where)
    nodes_per_group = _count(data, "nodes_per_group", where, required=False)
    if nodes_per_group is not None and nodes_per_group > nodes:
        raise ConfigError(f"{where}: field 'nodes_per_group' ({nodes_per_group}) exceeds 'nodes' ({nodes})")
    needed = {"intra_node": gpus_per_node > 1, "inter_node": nodes > 1 and (nodes_per_group or nodes) > 1,
              "inter_group": nodes_per_group is not None and nodes_per_group < nodes}
    tables: dict[str, dict[str, float]] = {}
    for key, parse, required in (("bandwidth", parse_bandwidth, True), ("latency", parse_latency, False)):
        table = data.get(key)
        if table is None and not required:
            table = {}
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: field '{key}' must be a mapping of tiers ({', '.join(TIERS)}), "
                              f"got {table!r}")
        bad = sorted(set(table) - set(TIERS))
        if bad:
            raise ConfigError(f"{where}: {key}.{bad[0]}: unknown tier; use {', '.join(TIERS)}")
        tables[key] = {t: parse(v, f"{where}: {key}.{t}") for t, v in table.items()}
    for tier, need in needed.items():
        if need and tier not in tables["bandwidth"]:
            raise ConfigError(f"{where}: missing field 'bandwidth.{tier}' (this cluster's ranks use that tier)")
    for key in ("gpu_memory", "flops_per_gpu"):
        if data.get(key) is None:
            raise ConfigError(f"{where}: missing field '{key}'")
    backend = data.get("backend", "nccl")
    if backend not in BACKENDS:
        raise ConfigError(f"{where}: field 'backend' must be one of {', '.join(BACKENDS)}, got {backend!r}")
    shared = data.get("shared", [])
    if not isinstance(shared, list) or any(t not in _SHAREABLE for t in shared):
        raise ConfigError(f"{where}: field 'shared' must be a list of tiers among {', '.join(_SHAREABLE)}, "
                          f"got {shared!r}")
    for tier in shared:
        if tier not in tables["bandwidth"]:
            raise ConfigError(f"{where}: field 'shared' lists {tier} but 'bandwidth.{tier}' is not given")
    return Cluster(
        name=str(data.get("name", where)),
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        nodes_per_group=nodes_per_group,
        bandwidth=tables["bandwidth"],
        latency={t: tables["latency"].get(t, 0.0) for t in TIERS},
        gpu_memory=parse_memory(data["gpu_memory"], f"{where}: gpu_memory"),
        flops_per_gpu=parse_flops(data["flops_per_gpu"], f"{where}: flops_per_gpu"),
        backend=backend,
        shared=tuple(shared),
    )


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster YAML file (see examples/clusters/)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--cluster: cannot read {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"--cluster: {path} is not valid YAML: {exc}") from exc
    if isinstance(data, dict) and "name" not in data:
        data = {**data, "name": path.stem}
    return cluster_from_dict(data, where=str(path))


# ---------------------------------------------------------------------------------------------------------------------
# Model description.


def model_from_preset(name: str, vocab_size: int = 32000) -> ModelShape:
    """Shape of a preset of `flwr_sharded.training.models.PRESETS` (its own vocabulary, else `vocab_size`)."""
    if name not in PRESETS:
        raise ConfigError(f"--model: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[name]
    vocab = p.vocab_size or vocab_size
    root = vocab * p.hidden_size * (1 if p.tie_word_embeddings else 2) + p.hidden_size
    return ModelShape(num_params=p.num_parameters(vocab), num_layers=p.num_hidden_layers, root_params=root,
                      hidden_size=p.hidden_size, intermediate_size=p.intermediate_size, vocab_size=vocab, name=name)


# ---------------------------------------------------------------------------------------------------------------------
# Candidates.


@dataclass(frozen=True)
class Candidate:
    """One layout with its predicted cost per optimizer step."""

    method: str
    """fsdp, hsdp, fl-fsdp or fl-hsdp."""
    F: int
    """Federation groups."""
    R: int
    """Replication groups per federation group."""
    S: int
    """Ranks per sharding group."""
    A: int
    """Optimizer steps between shard syncs (1 for fsdp/hsdp)."""
    tiers: dict[str, str | None]
    """Slowest tier each mesh dimension spans (shard, replica, federation); None if the dimension has size 1."""
    bandwidth: dict[str, float | None]
    """Bits/s one flow of each dimension's collectives gets: its tier's, divided among flows on a shared uplink."""
    comm: CommTerms
    """Communication seconds per step, by kind."""
    compute: float
    """Compute seconds per step."""
    memory: MemoryEstimate
    """Bytes per GPU."""
    batch_tokens: int
    """Effective batch of one optimizer step of one model: all GPUs for fsdp/hsdp, one group (R x S GPUs) for FL."""
    fits: bool
    """Whether `memory` fits the usable GPU memory."""

    @property
    def step_time(self) -> float:
        """Predicted seconds per optimizer step: compute + communication."""
        return self.compute + self.comm.total

    @property
    def federated(self) -> bool:
        return self.method.startswith("fl-")

    def label(self) -> str:
        return f"{self.method} F={self.F} R={self.R} S={self.S} A={self.A}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(gpus: int, gpus_per_node: int, methods: tuple[str, ...] = METHODS,
            aggregate_every_options: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> list[tuple[str, int, int, int, int]]:
    """All (method, F, R, S, A) with F*R*S = gpus and S dividing a node or made of whole nodes.

    hsdp needs R > 1, fl-fsdp F > 1, fl-hsdp F > 1 and R > 1 (otherwise they are another method).
    """
    out = []
    for S in _divisors(gpus):
        if gpus_per_node % S and S % gpus_per_node:
            continue
        rest = gpus // S
        for F in _divisors(rest):
            R = rest // F
            method = ("fl-" if F > 1 else "") + ("hsdp" if R > 1 else "fsdp")
            if method not in methods:
                continue
            for A in (aggregate_every_options if F > 1 else (1,)):
                out.append((method, F, R, S, A))
    return out


def evaluate(cluster: Cluster, model: ModelShape, method: str, *, F: int = 1, R: int = 1, S: int, A: int = 1,
             tokens_per_gpu_batch: int = 4096, bytes_per_param: float = 2.0,
             state_bytes_per_param: float | None = None, sizes: str = "exact", latency: bool = False,
             activation_checkpointing: bool = False, memory_fraction: float = 0.9,
             sync_bytes_per_param: float | None = None) -> Candidate:
    """Predict one layout's step on `cluster` (see `plan` for the options)."""
    check_layout(method, S=S, R=R, F=F, A=A)
    if sync_bytes_per_param is not None and not sync_bytes_per_param > 0:
        raise ConfigError(f"sync_bytes_per_param must be positive, got {sync_bytes_per_param!r}")
    if F * R * S != cluster.gpus:
        raise ConfigError(f"layout F={F} x R={R} x S={S} = {F * R * S} ranks, but the cluster has {cluster.gpus} GPUs")
    placement = cluster.placement(F, R, S)
    tiers: dict[str, str | None] = {}
    bw: dict[str, float | None] = {}
    for dim in DIMENSIONS:
        # fl-hsdp: only replica r = 0 joins the cross-group all-reduce
        ranks = [placement.rank(0, 0, s) for s in range(S)] if dim == "federation" and method == "fl-hsdp" else None
        tiers[dim] = placement.dim_tier(dim, ranks)
        bw[dim] = cluster.bandwidth[tiers[dim]] if tiers[dim] else None
        if bw[dim] and cluster.shared:
            flows = placement.flows(dim, ranks)
            for tier in cluster.shared:
                if flows[tier]:
                    bw[dim] = min(bw[dim], cluster.bandwidth[tier] / flows[tier])
    alpha = {dim: (cluster.latency[t] if t and latency else 0.0) for dim, t in tiers.items()}
    comm = comm_terms(method, model.units(bytes_per_param), S=S, R=R, F=F, A=A, B_S=bw["shard"],
                      B_R=bw["replica"], B_F=bw["federation"], sizes=sizes, backend=cluster.backend,
                      alpha_S=alpha["shard"], alpha_R=alpha["replica"], alpha_F=alpha["federation"],
                      wire_ratio=(sync_bytes_per_param or bytes_per_param) / bytes_per_param)
    compute = compute_time(model.num_params, tokens_per_gpu_batch, cluster.flops_per_gpu,
                           flops_per_param_token=8.0 if activation_checkpointing else 6.0)
    memory = memory_per_gpu(model, S=S, tokens=tokens_per_gpu_batch, bytes_per_param=bytes_per_param,
                            state_bytes_per_param=state_bytes_per_param,
                            activation_checkpointing=activation_checkpointing)
    group_gpus = R * S if method.startswith("fl-") else cluster.gpus
    return Candidate(method=method, F=F, R=R, S=S, A=A, tiers=tiers, bandwidth=bw, comm=comm, compute=compute,
                     memory=memory, batch_tokens=group_gpus * tokens_per_gpu_batch,
                     fits=memory.total <= memory_fraction * cluster.gpu_memory)


def plan(cluster: Cluster, model: ModelShape, *, tokens_per_gpu_batch: int = 4096,
         aggregate_every_options: tuple[int, ...] = (1, 2, 4, 8, 16, 32), methods: tuple[str, ...] = METHODS,
         bytes_per_param: float = 2.0, state_bytes_per_param: float | None = None, sizes: str = "exact",
         latency: bool = False, activation_checkpointing: bool = False, memory_fraction: float = 0.9,
         fl_margin: float = 0.1, sync_bytes_per_param: float | None = None) -> list[Candidate]:
    """Every valid layout that fits in memory, best first.

    Ranked by predicted step time, except that an FL candidate ranks as if its step took (1 + `fl_margin`) times
    longer: a synchronous method (exact gradient averaging, no drift, no A to tune) is preferred unless FL saves
    more than that fraction. `sizes`: "exact" or "paper" message sizes (see `costmodel.comm_terms`); `latency`: add
    the cluster's per-tier latencies as an alpha term per ring step; `memory_fraction`: share of GPU memory a layout
    may use (the rest: CUDA context, NCCL buffers, fragmentation). An empty list means nothing fits.
    `sync_bytes_per_param`: bytes per parameter of the FL sync's cross-group all-reduce (4 float32, 2 bfloat16:
    `--sync-dtype`); None: `bytes_per_param`, like every other collective.
    """
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise ConfigError(f"--methods: choose among {', '.join(METHODS)}, got {', '.join(methods) or 'nothing'}")
    for A in aggregate_every_options:
        if isinstance(A, bool) or not isinstance(A, int) or A < 1:
            raise ConfigError(f"--aggregate-every: values must be integers >= 1, got {A!r}")
    _positive_int_option("--tokens-per-gpu", tokens_per_gpu_batch)
    if not 0 < memory_fraction <= 1:
        raise ConfigError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if fl_margin < 0:
        raise ConfigError(f"--fl-margin must be >= 0, got {fl_margin}")
    candidates = [
        evaluate(cluster, model, method, F=F, R=R, S=S, A=A, tokens_per_gpu_batch=tokens_per_gpu_batch,
                 bytes_per_param=bytes_per_param, state_bytes_per_param=state_bytes_per_param, sizes=sizes,
                 latency=latency, activation_checkpointing=activation_checkpointing, memory_fraction=memory_fraction,
                 sync_bytes_per_param=sync_bytes_per_param)
        for method, F, R, S, A in layouts(cluster.gpus, cluster.gpus_per_node, tuple(methods),
                                          tuple(aggregate_every_options))
    ]
    fitting = [c for c in candidates if c.fits]
    return sorted(fitting, key=lambda c: (c.step_time * (1 + fl_margin if c.federated else 1), c.A, c.F, c.R))


def _positive_int_option(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}: expected an integer >= 1, got {value!r}")


_TERM_NAMES = {"shard": "all-gathers/reduce-scatters over the sharding group",
               "replicate": "HSDP gradient all-reduces over the replication group",
               "sync": "the FL shard sync", "latency": "collective latency"}


def explain(best: Candidate, reference: Candidate | None, fastest: Candidate, fl_margin: float) -> str:
    """Why `best` is recommended: step time, dominant term, speedup over plain FSDP."""
    terms = {"shard": best.comm.shard, "replicate": best.comm.replicate, "sync": best.comm.sync,
             "latency": best.comm.latency}
    dominant = max(terms, key=terms.get)
    tier = {"shard": best.tiers["shard"], "replicate": best.tiers["replica"],
            "sync": best.tiers["federation"], "latency": None}[dominant]
    where = f" ({tier})" if tier else ""
    bound = "compute" if best.compute >= best.comm.total else "communication"
    mostly = f", mostly {_TERM_NAMES[dominant]}{where}" if best.comm.total > 0 else ""
    text = (f"{best.label()}: {best.step_time:.3g} s/step = {best.compute:.3g} s compute + {best.comm.total:.3g} s "
            f"communication{mostly}; {bound}-bound")
    if reference is not None and best.method != "fsdp":
        text += (f"; {reference.step_time / best.step_time:.2f}x faster than fsdp S={reference.S} "
                 f"({reference.step_time:.3g} s/step)")
    if fastest.federated and not best.federated:
        text += (f"; {fastest.label()} would be {fastest.step_time:.3g} s/step, but FL must save more than "
                 f"{fl_margin:.0%} to beat a synchronous method")
    if best.federated:
        text += (f"; each group steps on {best.batch_tokens:,} tokens; larger A saves communication but lets groups "
                 f"drift (the paper used A=8)")
    return text


# ---------------------------------------------------------------------------------------------------------------------
# The paper's four 512-GPU layouts and its measured times.

PAPER_LAYOUTS: tuple[tuple[str, str, int, int, int], ...] = (
    ("FSDP", "fsdp", 1, 1, 512),
    ("HSDP", "hsdp", 1, 128, 4),
    ("FL+FSDP", "fl-fsdp", 128, 1, 4),
    ("FL+HSDP", "fl-hsdp", 16, 8, 4),
)
"""(label, method, F, R, S) of the paper's experiments: Llama-3.1-8B on 128 Leonardo nodes x 4 A100, A = 8."""

PAPER_TABLE4: dict[str, dict[str, tuple[float, float]]] = {
    "FSDP": {"forward": (4.53, 0.16), "backward": (7.50, 0.20), "optimizer": (0.00, 0.00),
             "aggregation": (0.00, 0.00), "overall": (12.04, 0.26)},
    "HSDP": {"forward": (0.37, 0.00), "backward": (1.43, 0.15), "optimizer": (0.03, 0.00),
             "aggregation": (0.00, 0.00), "overall": (1.84, 0.15)},
    "FL+FSDP": {"forward": (0.37, 0.00), "backward": (0.89, 0.00), "optimizer": (0.03, 0.00),
                "aggregation": (0.17, 0.55), "overall": (1.45, 0.54)},
    "FL+HSDP": {"forward": (0.38, 0.02), "backward": (0.99, 0.01), "optimizer": (0.03, 0.00),
                "aggregation": (0.14, 0.54), "overall": (1.53, 0.54)},
}
"""Reference figures, measured (not predicted): the paper's Table 4, seconds per batch (mean, std) by phase, for
Llama-3.1-8B on 512 A100 GPUs of Leonardo, batch 2 x 2048 tokens per GPU, aggregation every 8 steps."""


@dataclass(frozen=True)
class PaperRow:
    """One of the paper's layouts: predicted step time next to the paper's measurement."""

    label: str
    """FSDP, HSDP, FL+FSDP or FL+HSDP."""
    predicted: Candidate
    """The cost model's prediction with exact message sizes."""
    paper_eq_comm: float
    """Communication seconds per step from Eqs. 1-5 literally (M = model bits / number of units)."""
    measured: dict[str, tuple[float, float]]
    """The paper's Table 4 row (mean, std) by phase."""


def paper_layouts(cluster: Cluster, model: ModelShape | None = None, *, A: int = 8, tokens_per_gpu_batch: int = 4096,
                  bytes_per_param: float = 2.0, latency: bool = False) -> list[PaperRow]:
    """Predictions for the paper's four layouts (needs a 512-GPU cluster) next to Table 4."""
    if cluster.gpus != 512:
        raise ConfigError(f"--layouts paper: the paper's layouts use 512 GPUs, cluster {cluster.name} has "
                          f"{cluster.gpus}")
    model = model or model_from_preset("llama3.1-8b")
    rows = []
    for label, method, F, R, S in PAPER_LAYOUTS:
        a = A if F > 1 else 1
        kwargs = dict(F=F, R=R, S=S, A=a, tokens_per_gpu_batch=tokens_per_gpu_batch, bytes_per_param=bytes_per_param)
        exact = evaluate(cluster, model, method, latency=latency, **kwargs)
        literal = evaluate(cluster, model, method, sizes="paper", **kwargs)
        rows.append(PaperRow(label=label, predicted=exact, paper_eq_comm=literal.comm.total,
                             measured=PAPER_TABLE4[label]))
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Command line.


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _count_arg(text: str) -> int:
    try:
        value = int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 8000000000 or 8e9, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `plan` sub-command; its handler is set with `set_defaults(func=...)` and returns an exit code."""
    p = subparsers.add_parser(
        "plan", help="rank (method, F, R, S, A) layouts for a cluster with the communication cost model",
        description="Predict compute + communication per optimizer step for every layout using all GPUs of a "
                    "cluster, rank them and recommend one (see docs/cost-model.md).")
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster YAML (see examples/clusters/)")
    p.add_argument("--model", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--params", type=_count_arg, metavar="N", help="parameter count of a model without preset")
    p.add_argument("--layers", type=int, metavar="L", help="transformer blocks of that model (with --params)")
    p.add_argument("--hidden-size", type=int, help="model width for the activation estimate (with --params)")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary for presets without one (32000)")
    p.add_argument("--bytes-per-param", type=float, default=2.0, help="bytes per parameter on the wire (2: bf16)")
    p.add_argument("--sync-dtype", choices=tuple(SYNC_DTYPE_BYTES), default=None,
                   help="wire dtype of the FL shard sync's all-reduce (flwr-sharded train --sync-dtype): its bits = "
                        "parameters x the dtype's bits (default: --bytes-per-param, like the other collectives)")
    p.add_argument("--state-bytes-per-param", type=float, default=None,
                   help="bytes per parameter of params+grads+AdamW state (default 4 x --bytes-per-param)")
    p.add_argument("--tokens-per-gpu", type=int, default=2 * 2048,
                   help="tokens per GPU per step (default 4096: the paper's 2 x 2048)")
    p.add_argument("--aggregate-every", type=_int_list, default=(1, 2, 4, 8, 16, 32), metavar="LIST",
                   help="values of A to try for FL methods, e.g. 1,4,8 (default 1,2,4,8,16,32)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="methods to consider")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("--sizes", choices=("exact", "paper"), default="exact",
                   help="message sizes: each collective's own (exact) or one M for all as Eqs. 1-5 (paper)")
    p.add_argument("--latency", action="store_true", help="add the cluster's per-tier latency per ring step")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="assume activation checkpointing: less activation memory, 8 instead of 6 FLOPs/param/token")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="usable share of GPU memory (0.9)")
    p.add_argument("--fl-margin", type=float, default=0.1,
                   help="FL must be this fraction faster than a synchronous method to rank above it (0.1)")
    p.add_argument("--layouts", choices=("paper",),
                   help="instead of planning, predict the paper's four 512-GPU layouts next to its Table 4")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    return p


def _model_from_args(args: argparse.Namespace) -> ModelShape | None:
    if args.model and args.params:
        raise ConfigError("--model and --params are exclusive: give a preset or a parameter count with --layers")
    if args.model:
        return model_from_preset(args.model, args.vocab_size)
    if args.params:
        if not args.layers:
            raise ConfigError("--params needs --layers (number of transformer blocks)")
        return ModelShape.from_counts(args.params, args.layers, hidden_size=args.hidden_size,
                                      vocab_size=args.vocab_size)
    return None


def _candidate_dict(c: Candidate) -> dict[str, Any]:
    return {"method": c.method, "F": c.F, "R": c.R, "S": c.S, "A": c.A, "tiers": c.tiers, "bandwidth": c.bandwidth,
            "comm_s": c.comm.total, "comm_terms_s": asdict(c.comm), "compute_s": c.compute, "step_s": c.step_time,
            "batch_tokens": c.batch_tokens, "memory_gib": c.memory.total / GiB,
            "memory_terms_gib": {k: v / GiB for k, v in asdict(c.memory).items()}}


def _header(cluster: Cluster, model: ModelShape, args: argparse.Namespace) -> str:
    groups = f", node groups of {cluster.nodes_per_group} nodes" if cluster.nodes_per_group else ""
    return (f"Cluster {cluster.name}: {cluster.nodes} x {cluster.gpus_per_node} GPUs = {cluster.gpus}{groups}; "
            f"model {model.name} ({model.num_params / 1e9:.3g} B params, {args.bytes_per_param:g} bytes each); "
            f"{args.tokens_per_gpu} tokens per GPU per step"
            + (f"; FL sync in {args.sync_dtype}" if args.sync_dtype else ""))


def _print_paper(cluster: Cluster, rows: list[PaperRow], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps([{"layout": r.label, **_candidate_dict(r.predicted), "paper_eq_comm_s": r.paper_eq_comm,
                           "table4_measured": r.measured} for r in rows], indent=2))
        return
    print(f"Paper layouts on {cluster.name} ({args.model or 'llama3.1-8b'}, {args.tokens_per_gpu} tokens/GPU, A=8): "
          f"predicted s/step vs measured (the paper's Table 4: Llama-3.1-8B, 4096 tokens/GPU, s/batch)")
    print(f"{'layout':<8} {'F':>4} {'R':>4} {'S':>4} {'comm Eq.1-5':>11} {'comm exact':>10} {'compute':>8} "
          f"{'predicted':>9} {'Table 4':>12} {'fwd+bwd':>7} {'aggr.':>5}")
    for r in rows:
        c, m = r.predicted, r.measured
        overall = f"{m['overall'][0]:.2f}±{m['overall'][1]:.2f}"
        print(f"{r.label:<8} {c.F:>4} {c.R:>4} {c.S:>4} {r.paper_eq_comm:>11.3f} {c.comm.total:>10.3f} "
              f"{c.compute:>8.3f} {c.step_time:>9.3f} {overall:>12} {m['forward'][0] + m['backward'][0]:>7.2f} "
              f"{m['aggregation'][0]:>5.2f}")
    base = rows[0]
    print("Speedup over FSDP, predicted / measured: " + ", ".join(
        f"{r.label} {base.predicted.step_time / r.predicted.step_time:.2f}x / "
        f"{base.measured['overall'][0] / r.measured['overall'][0]:.2f}x" for r in rows[1:]))


def run(args: argparse.Namespace) -> int:
    """Handler of `flwr-sharded plan`."""
    try:
        cluster = load_cluster(args.cluster)
        model = _model_from_args(args)
        if args.layouts == "paper":
            rows = paper_layouts(cluster, model, tokens_per_gpu_batch=args.tokens_per_gpu,
                                 bytes_per_param=args.bytes_per_param, latency=args.latency)
            _print_paper(cluster, rows, args)
            return 0
        if model is None:
            raise ConfigError("give a model: --model PRESET, or --params N --layers L")
        options = dict(tokens_per_gpu_batch=args.tokens_per_gpu, bytes_per_param=args.bytes_per_param,
                       state_bytes_per_param=args.state_bytes_per_param, sizes=args.sizes, latency=args.latency,
                       activation_checkpointing=args.activation_checkpointing,
                       memory_fraction=args.memory_fraction,
                       sync_bytes_per_param=SYNC_DTYPE_BYTES.get(args.sync_dtype))
        candidates = plan(cluster, model, aggregate_every_options=tuple(args.aggregate_every),
                          methods=tuple(args.methods), fl_margin=args.fl_margin, **options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not candidates:
        smallest = evaluate(cluster, model, "fsdp", S=cluster.gpus, **options)
        print(f"error: no layout fits in {args.memory_fraction:.0%} of {cluster.gpu_memory / GiB:.1f} GiB per GPU "
              f"(fsdp over all {cluster.gpus} GPUs needs {smallest.memory.total / GiB:.1f} GiB); try "
              f"--activation-checkpointing, fewer --tokens-per-gpu or a bigger cluster", file=sys.stderr)
        return 1
    reference = evaluate(cluster, model, "fsdp", S=cluster.gpus, **options)
    fastest = min(candidates, key=lambda c: c.step_time)
    best = candidates[0]
    reason = explain(best, reference, fastest, args.fl_margin)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "model": model.name,
                          "candidates": [_candidate_dict(c) for c in candidates[:args.top]],
                          "recommended": _candidate_dict(best), "reason": reason}, indent=2))
        return 0
    print(_header(cluster, model, args))
    print(f"{'#':>3} {'method':<8} {'F':>4} {'R':>4} {'S':>4} {'A':>3} {'comm s/step':>11} {'total s/step':>12} "
          f"{'eff. batch tok':>14} {'mem/GPU GiB':>11}  tiers S/R/F")
    for i, c in enumerate(candidates[:args.top], 1):
        tiers = "/".join(c.tiers[d] or "-" for d in ("shard", "replica", "federation"))
        print(f"{i:>3} {c.method:<8} {c.F:>4} {c.R:>4} {c.S:>4} {c.A:>3} {c.comm.total:>11.4g} {c.step_time:>12.4g} "
              f"{c.batch_tokens:>14,} {c.memory.total / GiB:>11.1f}  {tiers}")
    print(f"Recommended: {reason}")
    return 0
