"""The calibrated model (a cluster YAML's `calibration` block): what a real fabric adds to the paper's bandwidth-only
costs, with one set of parameters per cluster (docs/cost-model.md, "Calibrated model"); bytes per tier are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flwr_sharded.errors import ConfigError

ADAMW_BYTES_PER_PARAM = 28.0
"""Bytes the trainer's AdamW step reads (fp32 weight, gradient, both moments: 16) and writes (weight, moments: 12) per
parameter."""
SGD_BYTES_PER_PARAM = 12.0
"""Bytes the trainer's momentum-free SGD step reads (weight, gradient) and writes (weight) per parameter."""


@dataclass(frozen=True)
class Calibration:
    """The calibrated model's parameters of one cluster (the YAML's `calibration` block); one declaration each."""

    tree_allreduce: bool = False
    """All-reduces across nodes run as NCCL's double binary tree: 2 (floor(log2 nodes) + ranks per node - 1)
    sequential steps instead of the ring's 2 (n-1) when fewer (NCCL's tuning model, src/graph/tuning.cc;
    all-gathers and reduce-scatters only have the ring). Off for gloo."""
    uplink: dict[str, float] = field(default_factory=dict)
    """Bits/s of the uplink of one node ("inter_node") or node group ("inter_group") that all flows leaving it at once
    share (a node's NICs together); a tier listed here is shared. Unset for a shared tier: its bandwidth."""
    efficiency: dict[str, float] = field(default_factory=dict)
    """Share (0, 1] of a shared uplink's capacity that the flows of a tier get under the fabric's load; unset: 1."""
    overlap: bool = False
    """A forward or backward takes max(compute, its collectives) instead of their sum (FSDP2 prefetches all-gathers and
    reduces on its own stream); the shard sync stays blocking. Off where collectives and compute share CPU cores."""
    memory_bandwidth: float = 0.0
    """Bytes/s of a GPU's memory for the optimizer step (memory-bound: `optimizer_time`); 0: not counted."""


def flow_bandwidth(tier_bandwidth: float, uplinks: dict[str, tuple[float, int]], efficiency: float = 1.0) -> float:
    """Bits/s one flow gets: min(its tier's bandwidth, each shared uplink's capacity x efficiency / its flows at
    once). `uplinks`: tier -> (capacity bits/s, flows)."""
    return min([tier_bandwidth] + [capacity * efficiency / flows for capacity, flows in uplinks.values() if flows])


def tree_allreduce_steps(nodes: int, ranks_per_node: int) -> int:
    """Sequential steps of NCCL's tree all-reduce: 2 (floor(log2 nodes) + ranks_per_node - 1)."""
    if nodes < 1 or ranks_per_node < 1:
        raise ConfigError(f"nodes and ranks_per_node must be >= 1, got {nodes} and {ranks_per_node}")
    return 2 * (int(math.floor(math.log2(nodes))) + ranks_per_node - 1)


def allreduce_steps(n: int, nodes: int, tree: bool) -> int:
    """Sequential steps of an all-reduce among n ranks on `nodes` nodes: the ring's 2 (n-1), or with `tree` the fewer
    of the ring's and the tree's (NCCL picks the faster)."""
    ring = 2 * (n - 1)
    return min(ring, tree_allreduce_steps(nodes, n // nodes)) if tree and n >= 2 else ring


def optimizer_time(params_per_rank: float, bytes_per_param: float, memory_bandwidth: float) -> float:
    """Seconds of a memory-bound optimizer step: parameters x bytes per parameter / memory bandwidth (0 without)."""
    return params_per_rank * bytes_per_param / memory_bandwidth if memory_bandwidth > 0 else 0.0


@dataclass(frozen=True)
class Phases:
    """Seconds per optimizer step by phase, as the paper's Table 4 splits them."""

    forward: float
    """Compute and the forward's all-gathers."""
    backward: float
    """Compute, the backward's all-gathers, reduce-scatters and HSDP's all-reduces."""
    optimizer: float
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
