"""The calibrated model: what a real cluster adds to the paper's bandwidth-only costs.

A cluster YAML's optional `calibration` block (`Calibration`) switches the planner from the paper's model (every
collective at its bottleneck bandwidth, nothing else) to one that also counts, with the same parameters for every
layout: the start-up latency of every sequential step of a collective (ring: n-1 or 2 (n-1) steps; NCCL's tree
all-reduce: 2 (log2 nodes + ranks per node - 1)), node uplinks shared by the flows leaving a node at once, the
goodput a loaded tier really delivers, the overlap of FSDP2's collectives with compute, and the optimizer step's
memory traffic. The terms and their sources are in docs/cost-model.md ("Calibrated model"); bytes per tier are
unchanged (`placement`), only times are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flwr_sharded.errors import ConfigError

ADAMW_BYTES_PER_PARAM = 28.0
"""Bytes the trainer's AdamW step reads and writes per parameter: reads fp32 weight, gradient and both moments
(16), writes weight and moments (12)."""
SGD_BYTES_PER_PARAM = 12.0
"""Bytes the trainer's momentum-free SGD step reads and writes per parameter: reads weight and gradient, writes the
weight (4 bytes each)."""


@dataclass(frozen=True)
class Calibration:
    """The calibrated model's parameters of one cluster (the YAML's `calibration` block); one declaration each."""

    tree_allreduce: bool = False
    """All-reduces across nodes run as NCCL's double binary tree: 2 (floor(log2 nodes) + ranks per node - 1)
    sequential steps instead of the ring's 2 (n-1) (NCCL's tuning model, src/graph/tuning.cc, picks the tree when
    it is faster; all-gathers and reduce-scatters only have the ring). Off for gloo (ring all-reduce)."""
    uplink: dict[str, float] = field(default_factory=dict)
    """Bits/s of the uplink of one node ("inter_node") or node group ("inter_group") that all flows leaving it at once
    share (a node's NICs together); a tier listed here is shared. Unset for a shared tier: its bandwidth."""
    efficiency: dict[str, float] = field(default_factory=dict)
    """Share (0, 1] of a shared uplink's capacity that the flows of a tier get under the fabric's load (noise from
    other jobs, routing); unset: 1. The tier's own bandwidth already states what a lone flow gets."""
    overlap: bool = False
    """FSDP2 prefetches all-gathers and issues reduce-scatters (and HSDP's all-reduces) on their own stream, so a
    forward or backward takes max(compute, its collectives) instead of their sum; the shard sync does not overlap
    (blocking). Off where collectives and compute share the CPU cores (gloo on this machine)."""
    memory_bandwidth: float = 0.0
    """Bytes/s of a GPU's memory for the optimizer step (memory-bound: `optimizer_time`); 0: not counted."""


def _fraction(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{where}: expected a share in (0, 1], got {value!r}")
    return float(value)


def calibration_from_dict(data: Any, where: str, parse_bandwidth, tiers: tuple[str, ...],
                          shareable: tuple[str, ...]) -> Calibration:
    """Validate a `calibration` mapping; ConfigError names the field. `parse_bandwidth(value, field)` parses rates."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    known = {"tree_allreduce", "uplink", "efficiency", "overlap", "memory_bandwidth"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for flag in ("tree_allreduce", "overlap"):
        if not isinstance(data.get(flag, False), bool):
            raise ConfigError(f"{where}.{flag}: expected true or false, got {data[flag]!r}")
    tables = {}
    for key, allowed in (("uplink", shareable), ("efficiency", tiers)):
        table = data.get(key, {})
        if not isinstance(table, dict) or any(t not in allowed for t in table):
            raise ConfigError(f"{where}.{key}: expected a mapping of tiers among {', '.join(allowed)}, got {table!r}")
        tables[key] = table
    mem = data.get("memory_bandwidth", 0)
    return Calibration(
        tree_allreduce=data.get("tree_allreduce", False),
        uplink={t: parse_bandwidth(v, f"{where}.uplink.{t}") for t, v in tables["uplink"].items()},
        efficiency={t: _fraction(v, f"{where}.efficiency.{t}") for t, v in tables["efficiency"].items()},
        overlap=data.get("overlap", False),
        memory_bandwidth=0.0 if mem == 0 else parse_bandwidth(mem, f"{where}.memory_bandwidth") / 8,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Formulas.


def flow_bandwidth(tier_bandwidth: float, uplinks: dict[str, tuple[float, int]], efficiency: float = 1.0) -> float:
    """Bits/s one flow of a collective gets: min(its tier's bandwidth, each shared uplink's capacity x the tier's
    efficiency / the flows leaving through it at once). `uplinks`: tier -> (capacity bits/s, flows)."""
    bw = tier_bandwidth
    for capacity, flows in uplinks.values():
        if flows:
            bw = min(bw, capacity * efficiency / flows)
    return bw


def tree_allreduce_steps(nodes: int, ranks_per_node: int) -> int:
    """Sequential steps of NCCL's tree all-reduce: up and down a tree of floor(log2 nodes) levels across nodes and a
    chain of ranks_per_node - 1 inside each: 2 (floor(log2 nodes) + ranks_per_node - 1)."""
    if nodes < 1 or ranks_per_node < 1:
        raise ConfigError(f"nodes and ranks_per_node must be >= 1, got {nodes} and {ranks_per_node}")
    return 2 * (int(math.floor(math.log2(nodes))) + ranks_per_node - 1)


def allreduce_steps(n: int, nodes: int, tree: bool) -> int:
    """Sequential steps of an all-reduce among n ranks on `nodes` nodes: the ring's 2 (n-1), or with `tree` the
    fewer of the ring's and the tree's (NCCL picks the faster; the bandwidth terms are alike)."""
    ring = 2 * (n - 1)
    if not tree or n < 2:
        return ring
    return min(ring, tree_allreduce_steps(nodes, n // nodes))


def optimizer_time(params_per_rank: float, bytes_per_param: float, memory_bandwidth: float) -> float:
    """Seconds of a memory-bound optimizer step: params_per_rank x bytes read and written per parameter / memory
    bandwidth (bytes/s); 0 without a memory bandwidth."""
    if memory_bandwidth <= 0:
        return 0.0
    return params_per_rank * bytes_per_param / memory_bandwidth


@dataclass(frozen=True)
class Phases:
    """Seconds per optimizer step by phase, as the paper's Table 4 splits them."""

    forward: float
    """Forward: compute and the forward's all-gathers."""
    backward: float
    """Backward: compute, the backward's all-gathers, reduce-scatters and HSDP's all-reduces."""
    optimizer: float
    """The optimizer step."""
    aggregation: float
    """The FL shard sync, amortised over A."""

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer + self.aggregation

    def as_dict(self) -> dict[str, float]:
        return {"forward": self.forward, "backward": self.backward, "optimizer": self.optimizer,
                "aggregation": self.aggregation, "overall": self.total}


def phase_time(compute: float, comm: float, overlap: bool) -> float:
    """A forward or backward: compute + its collectives, or with `overlap` the longer of the two."""
    return max(compute, comm) if overlap else compute + comm
