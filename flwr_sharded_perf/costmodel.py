"""The communication cost model (docs/cost-model.md): the paper's (`comm_terms`) and the calibrated one."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from flwr_sharded.config import METHODS
from flwr_sharded.errors import ConfigError

Backend = Literal["nccl", "gloo"]
Sizes = Literal["exact", "paper"]
BACKENDS = ("nccl", "gloo")


def _check_collective(D: float, n: int, B: float | None) -> None:
    if D < 0:
        raise ConfigError(f"message size D must be >= 0 bits, got {D}")
    if n < 1:
        raise ConfigError(f"number of processes n must be >= 1, got {n}")
    if n > 1 and (B is None or B <= 0):
        raise ConfigError(f"bandwidth B must be positive (bits/s) for a collective among {n} processes, got {B}")


def all_gather_time(D: float, n: int, B: float | None) -> float:
    """C_AG(D, n) = D (n-1) / (n B); 0 for n = 1."""
    _check_collective(D, n, B)
    return 0.0 if n == 1 else D * (n - 1) / (n * B)


def reduce_scatter_time(D: float, n: int, B: float | None) -> float:
    """C_RS(D, n) = C_AG(D, n)."""
    return all_gather_time(D, n, B)


def all_reduce_time(D: float, n: int, B: float | None) -> float:
    """C_AR(D, n) = 2 D (n-1) / (n B); 0 for n = 1."""
    _check_collective(D, n, B)
    return 0.0 if n == 1 else 2 * D * (n - 1) / (n * B)


def broadcast_time(D: float, n: int, B: float | None) -> float:
    """C_BC(D, n) = D / B; 0 for n = 1."""
    _check_collective(D, n, B)
    return 0.0 if n == 1 else D / B


def positive_int(name: str, value: int) -> None:
    """ConfigError naming `name` unless `value` is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def _check_bandwidth(name: str, value: float | None, needed: bool, why: str) -> None:
    if value is None and needed:
        raise ConfigError(f"{name} (bits/s) is required {why}")
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ConfigError(f"{name} must be a positive bandwidth in bits/s, got {value!r}")


def check_layout(method: str, *, S: int, R: int = 1, F: int = 1, A: int = 1) -> None:
    """Raise ConfigError unless (method, F, R, S, A) is a valid layout."""
    if method not in METHODS:
        raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    for name, value in (("S", S), ("R", R), ("F", F), ("A", A)):
        positive_int(name, value)
    if method == "fsdp" and (R > 1 or F > 1):
        raise ConfigError(f"fsdp needs R=1 and F=1 (got R={R}, F={F}); use hsdp, fl-fsdp or fl-hsdp")
    if method == "hsdp" and F > 1:
        raise ConfigError(f"hsdp needs F=1 (got F={F}); use fl-hsdp")
    if method == "fl-fsdp" and R > 1:
        raise ConfigError(f"fl-fsdp needs R=1 (got R={R}); use fl-hsdp")
    if not method.startswith("fl-") and A != 1:
        raise ConfigError(f"A (aggregate every) applies to FL methods only; {method} needs A=1, got {A}")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def _check_bandwidths(method: str, S: int, R: int, F: int, B_S: float | None, B_R: float | None,
                      B_F: float | None) -> None:
    """Raise ConfigError for a missing bandwidth the layout needs or a non-positive one."""
    _check_bandwidth("B_S", B_S, S > 1, f"for S={S} > 1")
    _check_bandwidth("B_R", B_R, R > 1 and method in ("hsdp", "fl-hsdp"), f"by {method} with R={R} > 1")
    _check_bandwidth("B_F", B_F, F > 1 and method.startswith("fl-"), f"by {method} with F={F} > 1")


@dataclass(frozen=True)
class Units:
    """The FSDP2 units of a model (one `fully_shard` call each), in bytes of parameters on the wire."""

    blocks: tuple[float, ...]
    """Bytes of each transformer block (one unit each)."""
    root: float = 0.0
    """Bytes of the root module's remaining parameters (embeddings, head, final norm); 0 if none."""

    def __post_init__(self) -> None:
        if not self.blocks or any(b <= 0 for b in self.blocks) or self.root < 0:
            raise ConfigError(f"units need at least one block, positive block sizes and root >= 0, got {self}")

    @property
    def total(self) -> float:
        """Bytes of the whole model."""
        return sum(self.blocks) + self.root

    @property
    def count(self) -> int:
        """Number of units, root included when it holds parameters (the paper's L)."""
        return len(self.blocks) + (1 if self.root > 0 else 0)

    def all(self) -> tuple[float, ...]:
        """Sizes of every unit, blocks first."""
        return self.blocks + ((self.root,) if self.root > 0 else ())


@dataclass(frozen=True)
class CommTerms:
    """Seconds per optimizer step in each kind of collective (summed: no overlap, as in the paper)."""

    shard: float
    """All-gathers and reduce-scatters over the sharding group (B_S)."""
    replicate: float = 0.0
    """HSDP's all-reduce of gradient shards over the replication group (B_R)."""
    sync: float = 0.0
    """FL shard sync, amortised over A: all-reduce over the federation group (B_F), fl-hsdp's broadcast (B_R)."""
    latency: float = 0.0
    """Alpha term: start-up latency per ring step of every collective (0 unless latencies are given)."""
    hidden: float = 0.0
    """Sync seconds per step that an overlapped sync hides behind local steps (`overlapped`); not in `total`."""
    forward: float = 0.0
    """Seconds of `shard` and `latency` that the forward's all-gathers take (included in them)."""
    sync_latency: float = 0.0
    """Seconds of `latency` that the sync's collectives take, amortised over A (included in it)."""

    @property
    def total(self) -> float:
        return self.shard + self.replicate + self.sync + self.latency


def overlapped(terms: CommTerms, *, A: int, fragments: int = 1, delay: int = 0, local_step: float) -> CommTerms:
    """`terms` with an overlapped sync (`--sync-fragments` N, `--sync-delay` tau): exposed sync = N max(0, sync A / N
    - tau local_step) / A, the rest `hidden`."""
    for name, value in (("A", A), ("fragments", fragments)):
        positive_int(name, value)
    if delay < 0 or not local_step >= 0:
        raise ConfigError(f"delay and local_step must be >= 0, got {delay!r} and {local_step!r}")
    if delay == 0:
        return terms
    per_fragment = terms.sync * A / fragments
    exposed = max(0.0, per_fragment - delay * local_step) * fragments / A
    return replace(terms, sync=exposed, hidden=terms.sync - exposed)


def comm_terms(method: str, units: Units, *, S: int, R: int = 1, F: int = 1, A: int = 1, B_S: float | None,
               B_R: float | None = None, B_F: float | None = None, sizes: Sizes = "exact", backend: Backend = "nccl",
               reshard_after_forward: bool = True, reshard_root: bool = False, alpha_S: float = 0.0,
               alpha_R: float = 0.0, alpha_F: float = 0.0, wire_ratio: float = 1.0, steps_R: int | None = None,
               steps_F: int | None = None) -> CommTerms:
    """Communication seconds per optimizer step by kind, with Eqs. 1-5's one message size (`sizes="paper"`) or each
    collective's own (docs/cost-model.md); `alpha_*`: seconds per sequential step of a collective, `steps_R` /
    `steps_F`: an all-reduce's steps (None: the ring's); `wire_ratio`: the sync's wire bytes over the units'."""
    check_layout(method, S=S, R=R, F=F, A=A)
    _check_bandwidths(method, S, R, F, B_S, B_R, B_F)
    if sizes not in ("exact", "paper"):
        raise ConfigError(f"sizes must be 'exact' or 'paper', got {sizes!r}")
    check_backend(backend)
    if not wire_ratio > 0:
        raise ConfigError(f"wire_ratio must be positive, got {wire_ratio!r}")
    hsdp = method in ("hsdp", "fl-hsdp")
    syncs = method.startswith("fl-") and F > 1
    if sizes == "paper":
        L = units.count
        M = units.total * 8 / L
        gathers, reduces, shard_msgs = [(2, M)] * L, [(1.0, M)] * L, [M] * L
    else:
        rs_factor = 2.0 if backend == "gloo" else 1.0
        gathers = [(2 if reshard_after_forward else 1, b * 8) for b in units.blocks]
        if units.root > 0:
            gathers.append((2 if reshard_root else 1, units.root * 8))
        reduces = [(rs_factor, u * 8) for u in units.all()]
        shard_msgs = [u * 8 / S for u in units.all()]
    shard = sum(k * all_gather_time(D, S, B_S) for k, D in gathers)
    shard += sum(k * reduce_scatter_time(D, S, B_S) for k, D in reduces)
    replicate = sum(all_reduce_time(D, R, B_R) for D in shard_msgs) if hsdp else 0.0
    broadcast = sum(broadcast_time(D, R, B_R) for D in shard_msgs) if method == "fl-hsdp" and syncs else 0.0
    sync = (sum(all_reduce_time(D * wire_ratio, F, B_F) for D in shard_msgs) + broadcast) / A if syncs else 0.0
    n_units = len(shard_msgs)
    steps_R = 2 * (R - 1) if steps_R is None else steps_R
    steps_F = 2 * (F - 1) if steps_F is None else steps_F
    latency = (sum(k for k, _ in gathers) + len(reduces)) * (S - 1) * alpha_S + n_units * steps_R * alpha_R * hsdp
    sync_latency = n_units * (steps_F * alpha_F + (R - 1 if method == "fl-hsdp" else 0) * alpha_R) / A if syncs else 0.0
    # the forward gathers every unit once: its share of the all-gathers' time and steps
    forward = sum(all_gather_time(D, S, B_S) for _, D in gathers) + len(gathers) * (S - 1) * alpha_S
    return CommTerms(shard=shard, replicate=replicate, sync=sync, latency=latency + sync_latency, forward=forward,
                     sync_latency=sync_latency)


ADAMW_BYTES_PER_PARAM = 28.0
"""Bytes the trainer's AdamW step reads (weight, gradient, moments: 16) and writes (12) per parameter (fp32)."""
SGD_BYTES_PER_PARAM = 12.0
"""Bytes the trainer's momentum-free SGD step reads (weight, gradient) and writes (weight) per parameter."""


@dataclass(frozen=True)
class Calibration:
    """The calibrated model's parameters of one cluster (the YAML's `calibration` block); one declaration each."""

    tree_allreduce: bool = False
    """All-reduces across nodes run as NCCL's tree when it takes fewer steps than the ring (`allreduce_steps`)."""
    uplink: dict[str, float] = field(default_factory=dict)
    """Bits/s of the uplink of one node ("inter_node") or node group ("inter_group") that all flows leaving it at once
    share (a node's NICs together); a tier listed here is shared. Unset for a shared tier: its bandwidth."""
    efficiency: dict[str, float] = field(default_factory=dict)
    """Share (0, 1] of a shared uplink's capacity that the flows of a tier get under the fabric's load; unset: 1."""
    overlap: bool = False
    """A forward or backward takes max(compute, its collectives) instead of their sum; the shard sync stays blocking."""
    memory_bandwidth: float = 0.0
    """Bytes/s of a GPU's memory for the optimizer step (memory-bound: `optimizer_time`); 0: not counted."""


def flow_bandwidth(tier_bandwidth: float, uplinks: dict[str, tuple[float, int]], efficiency: float = 1.0) -> float:
    """Bits/s one flow gets: min(its tier's, each uplink's capacity x efficiency / its flows at once)."""
    return min([tier_bandwidth] + [capacity * efficiency / flows for capacity, flows in uplinks.values() if flows])


def tree_allreduce_steps(nodes: int, ranks_per_node: int) -> int:
    """Sequential steps of NCCL's tree all-reduce: 2 (floor(log2 nodes) + ranks_per_node - 1)."""
    if nodes < 1 or ranks_per_node < 1:
        raise ConfigError(f"nodes and ranks_per_node must be >= 1, got {nodes} and {ranks_per_node}")
    return 2 * (int(math.floor(math.log2(nodes))) + ranks_per_node - 1)


def allreduce_steps(n: int, nodes: int, tree: bool) -> int:
    """Sequential steps of an all-reduce among n ranks on `nodes` nodes: the ring's, or with `tree` the fewer."""
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
