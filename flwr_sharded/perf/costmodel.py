"""Cost model of FSDP, HSDP, FL+FSDP and FL+HSDP: the paper's Section 4, bytes per network tier, compute and memory.

Three layers, from the paper to the wire:

- Table 1 collective costs and Eqs. 1-5, literally (`comm_time`, `fl_comm_time`): one message size M for every
  collective, in bits, bandwidths in bits/s.
- `comm_terms`: the same sums of Table 1 costs, but either literally (`sizes="paper"`) or with each collective's own
  message (`sizes="exact"`): FSDP2's all-gathers/reduce-scatters move a whole unit (NCCL's D for these is the gathered
  buffer), HSDP's all-reduce and the shard sync move one shard of it (the unit / S).
- `rank_traffic` / `traffic`: bytes each rank sends per optimizer step on each tier (intra-node, inter-node,
  inter-group) for the collectives FSDP2 and the shard sync issue, with ring algorithms.

No latency, overlap or contention unless stated; see docs/cost-model.md.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from flwr_sharded.config import METHODS

from flwr_sharded.errors import ConfigError

TIERS = ("intra_node", "inter_node", "inter_group")
"""Network tiers, fastest first: same node, same node group (rack, cell, facility), different groups."""
Tier = Literal["intra_node", "inter_node", "inter_group"]
Backend = Literal["nccl", "gloo"]
Sizes = Literal["exact", "paper"]
BACKENDS = ("nccl", "gloo")

# ---------------------------------------------------------------------------------------------------------------------
# Table 1: cost of one collective among n processes, message size D bits, bottleneck bandwidth B bits/s.


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
    """C_RS(D, n) = D (n-1) / (n B); 0 for n = 1."""
    _check_collective(D, n, B)
    return 0.0 if n == 1 else D * (n - 1) / (n * B)


def all_reduce_time(D: float, n: int, B: float | None) -> float:
    """C_AR(D, n) = 2 D (n-1) / (n B); 0 for n = 1."""
    _check_collective(D, n, B)
    return 0.0 if n == 1 else 2 * D * (n - 1) / (n * B)


def broadcast_time(D: float, n: int, B: float | None) -> float:
    """C_BC(D, n) = D / B; 0 for n = 1."""
    _check_collective(D, n, B)
    return 0.0 if n == 1 else D / B


# ---------------------------------------------------------------------------------------------------------------------
# Eqs. 1-5.


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def _check_bandwidth(name: str, value: float | None, needed: bool, why: str) -> None:
    if value is None:
        if needed:
            raise ConfigError(f"{name} (bits/s) is required {why}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a positive bandwidth in bits/s, got {value!r}")


def check_layout(method: str, *, S: int, R: int = 1, F: int = 1, A: int = 1) -> None:
    """Raise ConfigError unless (method, F, R, S, A) is a valid layout."""
    if method not in METHODS:
        raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    for name, value in (("S", S), ("R", R), ("F", F), ("A", A)):
        _positive_int(name, value)
    if method == "fsdp" and (R > 1 or F > 1):
        raise ConfigError(f"fsdp needs R=1 and F=1 (got R={R}, F={F}); use hsdp, fl-fsdp or fl-hsdp")
    if method == "hsdp" and F > 1:
        raise ConfigError(f"hsdp needs F=1 (got F={F}); use fl-hsdp")
    if method == "fl-fsdp" and R > 1:
        raise ConfigError(f"fl-fsdp needs R=1 (got R={R}); use fl-hsdp")
    if not method.startswith("fl-") and A != 1:
        raise ConfigError(f"A (aggregate every) applies to FL methods only; {method} needs A=1, got {A}")


def _check_bandwidths(method: str, S: int, R: int, F: int, B_S: float | None, B_R: float | None,
                      B_F: float | None) -> None:
    """Raise ConfigError for a missing bandwidth the layout needs or a non-positive one."""
    _check_bandwidth("B_S", B_S, S > 1, f"for S={S} > 1")
    _check_bandwidth("B_R", B_R, R > 1 and method in ("hsdp", "fl-hsdp"), f"by {method} with R={R} > 1")
    _check_bandwidth("B_F", B_F, F > 1 and method.startswith("fl-"), f"by {method} with F={F} > 1")


def comm_time(method: str, *, M: float, L: int, S: int, R: int = 1, F: int = 1, A: int = 1, B_S: float | None,
              B_R: float | None = None, B_F: float | None = None) -> float:
    """Seconds of communication per batch, the paper's Eqs. 1 (fsdp), 2 (hsdp), 4 (fl-fsdp) and 5 (fl-hsdp).

    M is the message size of every collective in bits (the paper's "layer shard size"), L the number of sharded
    layers, B_S / B_R / B_F the bottleneck bandwidths (bits/s) inside a sharding, replication and federation group.
    With F = 1 nothing is aggregated, so the FL terms vanish (as does the broadcast of Eq. 5 for R = 1).
    """
    check_layout(method, S=S, R=R, F=F, A=A)
    _check_bandwidths(method, S, R, F, B_S, B_R, B_F)
    _positive_int("L", L)
    if not M > 0:
        raise ConfigError(f"M (bits) must be positive, got {M!r}")
    t = (2 * all_gather_time(M, S, B_S) + reduce_scatter_time(M, S, B_S)) * L  # Eq. 1
    if method in ("hsdp", "fl-hsdp"):
        t += all_reduce_time(M, R, B_R) * L  # Eq. 2
    if method.startswith("fl-") and F > 1:
        t += all_reduce_time(M, F, B_F) * L / A  # Eq. 4
        if method == "fl-hsdp":
            t += broadcast_time(M, R, B_R) * L / A  # Eq. 5
    return t


def fl_comm_time(*, M: float, L: int, F: int, A: int = 1, B_F: float | None) -> float:
    """Eq. 3: plain decentralised FedAvg, one all-reduce per layer every A batches: C_AR(M, F) L / A."""
    for name, value in (("L", L), ("F", F), ("A", A)):
        _positive_int(name, value)
    if not M > 0:
        raise ConfigError(f"M (bits) must be positive, got {M!r}")
    _check_bandwidth("B_F", B_F, F > 1, f"for F={F} > 1")
    return all_reduce_time(M, F, B_F) * L / A


# ---------------------------------------------------------------------------------------------------------------------
# Model units and per-collective message sizes.


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

    @classmethod
    def even(cls, total_bytes: float, n: int, root: float = 0.0) -> Units:
        """`n` equal blocks holding `total_bytes`, plus a root unit of `root` bytes."""
        _positive_int("number of units", n)
        return cls(blocks=(total_bytes / n,) * n, root=root)

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
    """Seconds per optimizer step spent in each kind of collective (summed: no overlap, as in the paper)."""

    shard: float
    """All-gathers and reduce-scatters over the sharding group (B_S)."""
    replicate: float = 0.0
    """HSDP's all-reduce of gradient shards over the replication group (B_R)."""
    sync: float = 0.0
    """FL shard sync, amortised over A: all-reduce over the federation group (B_F), fl-hsdp's broadcast (B_R)."""
    latency: float = 0.0
    """Alpha term: start-up latency per ring step of every collective (0 unless latencies are given)."""

    @property
    def total(self) -> float:
        return self.shard + self.replicate + self.sync + self.latency


def comm_terms(method: str, units: Units, *, S: int, R: int = 1, F: int = 1, A: int = 1, B_S: float | None,
               B_R: float | None = None, B_F: float | None = None, sizes: Sizes = "exact", backend: Backend = "nccl",
               reshard_after_forward: bool = True, reshard_root: bool = False, alpha_S: float = 0.0,
               alpha_R: float = 0.0, alpha_F: float = 0.0, wire_ratio: float = 1.0) -> CommTerms:
    """Communication time per optimizer step, split by kind, from Table 1's collective costs.

    `sizes="paper"`: Eqs. 1-5 literally, with L = `units.count` and M = the model's bits / L for every collective
    (so `comm_terms(...).total == comm_time(...)`; backend and resharding options are ignored).
    `sizes="exact"`: each collective with its own message: all-gathers and reduce-scatters of a whole unit over S
    (two all-gathers per block if `reshard_after_forward`, one for the root unless `reshard_root`, as FSDP2 keeps the
    root gathered from forward to backward), all-reduces and broadcasts of the unit's 1/S shard over R and F;
    with `backend="gloo"` a reduce-scatter costs an all-reduce (gloo implements it as one).
    `alpha_*` (seconds) add, per collective, alpha times its sequential ring steps: n-1 for an all-gather,
    reduce-scatter or chained broadcast, 2 (n-1) for an all-reduce; the sync issues one collective per unit.
    `wire_ratio` scales the sync's cross-group all-reduce (in both modes): its wire bytes per parameter over the
    units' (0.5 for a bfloat16 sync of 4-byte units); fl-hsdp's broadcast keeps the units' size.
    """
    check_layout(method, S=S, R=R, F=F, A=A)
    _check_bandwidths(method, S, R, F, B_S, B_R, B_F)
    if sizes not in ("exact", "paper"):
        raise ConfigError(f"sizes must be 'exact' or 'paper', got {sizes!r}")
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not wire_ratio > 0:
        raise ConfigError(f"wire_ratio must be positive, got {wire_ratio!r}")
    hsdp = method in ("hsdp", "fl-hsdp")
    syncs = method.startswith("fl-") and F > 1
    if sizes == "paper":
        L = units.count
        M = units.total * 8 / L
        gathers = [(2, M)] * L
        reduces = [(1.0, M)] * L
        shard_msgs = [M] * L
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
    sync = 0.0
    if syncs:
        sync = sum(all_reduce_time(D * wire_ratio, F, B_F) for D in shard_msgs)
        if method == "fl-hsdp":
            sync += sum(broadcast_time(D, R, B_R) for D in shard_msgs)
        sync /= A
    n_units = len(shard_msgs)
    latency = (sum(k for k, _ in gathers) + len(reduces)) * (S - 1) * alpha_S
    if hsdp:
        latency += n_units * 2 * (R - 1) * alpha_R
    if syncs:
        latency += n_units * (2 * (F - 1) * alpha_F + (R - 1 if method == "fl-hsdp" else 0) * alpha_R) / A
    return CommTerms(shard=shard, replicate=replicate, sync=sync, latency=latency)


# ---------------------------------------------------------------------------------------------------------------------
# Placement and bytes per tier.

DIMENSIONS = ("shard", "replica", "federation")
"""Mesh dimensions: sharding group (S ranks), replication group (R), federation group (F)."""


@dataclass(frozen=True)
class Placement:
    """Where the ranks of an F x R x S mesh run: rank = f*R*S + r*S + s, filling nodes, then node groups, in order."""

    F: int
    """Federation groups."""
    R: int
    """Replication groups per federation group."""
    S: int
    """Ranks per sharding group (innermost)."""
    gpus_per_node: int
    """Ranks (GPUs) per node: node = rank // gpus_per_node."""
    nodes_per_group: int | None = None
    """Nodes per node group (rack, cell, facility): group = node // nodes_per_group; None: a single group."""

    def __post_init__(self) -> None:
        for name in ("F", "R", "S", "gpus_per_node"):
            _positive_int(name, getattr(self, name))
        if self.nodes_per_group is not None:
            _positive_int("nodes_per_group", self.nodes_per_group)

    @property
    def world_size(self) -> int:
        return self.F * self.R * self.S

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(f, r, s) of a rank."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {rank}")
        f, rest = divmod(rank, self.R * self.S)
        r, s = divmod(rest, self.S)
        return f, r, s

    def rank(self, f: int, r: int, s: int) -> int:
        return f * self.R * self.S + r * self.S + s

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def node_group(self, rank: int) -> int:
        return 0 if self.nodes_per_group is None else self.node(rank) // self.nodes_per_group

    def link_tier(self, a: int, b: int) -> Tier:
        """Tier of the link between two ranks."""
        if self.node(a) == self.node(b):
            return "intra_node"
        return "inter_node" if self.node_group(a) == self.node_group(b) else "inter_group"

    def group(self, dim: str, rank: int) -> list[int]:
        """Ranks of `rank`'s sharding ("shard"), replication ("replica") or federation ("federation") group, sorted."""
        f, r, s = self.coords(rank)
        if dim == "shard":
            return [self.rank(f, r, i) for i in range(self.S)]
        if dim == "replica":
            return [self.rank(f, i, s) for i in range(self.R)]
        if dim == "federation":
            return [self.rank(i, r, s) for i in range(self.F)]
        raise ConfigError(f"dimension must be one of {', '.join(DIMENSIONS)}, got {dim!r}")

    def span_tier(self, ranks: Sequence[int]) -> Tier | None:
        """Slowest tier among a set of ranks (their bottleneck); None for a single rank."""
        if len(ranks) < 2:
            return None
        nodes = {self.node(x) for x in ranks}
        if len(nodes) == 1:
            return "intra_node"
        return "inter_node" if len({self.node_group(x) for x in ranks}) == 1 else "inter_group"

    def groups(self, dim: str, ranks: Sequence[int] | None = None) -> list[list[int]]:
        """Every group of a dimension, or only the groups of `ranks`, each once."""
        if dim not in DIMENSIONS:
            raise ConfigError(f"dimension must be one of {', '.join(DIMENSIONS)}, got {dim!r}")
        if ranks is None:  # the first member of each group
            axis = DIMENSIONS.index(dim)
            ranks = [x for x in range(self.world_size) if self.coords(x)[2 - axis] == 0]
        unique = {tuple(self.group(dim, x)) for x in ranks}
        return [list(g) for g in sorted(unique)]

    def dim_tier(self, dim: str, ranks: Sequence[int] | None = None) -> Tier | None:
        """Slowest tier the groups of a dimension span (the paper's B_S, B_R, B_F tier); None if its size is 1.

        `ranks`: only the groups these ranks belong to (default: all).
        """
        tiers = {self.span_tier(g) for g in self.groups(dim, ranks)}
        tiers.discard(None)
        return max(tiers, key=TIERS.index) if tiers else None

    def flows(self, dim: str, ranks: Sequence[int] | None = None) -> dict[str, int]:
        """Most ring edges leaving one node ("inter_node") or one node group ("inter_group") when all groups of a
        dimension (or the groups of `ranks`) run their ring collective at once: the flows sharing that uplink."""
        leaving: dict[str, Counter] = {"inter_node": Counter(), "inter_group": Counter()}
        for group in self.groups(dim, ranks):
            if len(group) < 2:
                continue
            for a, b in zip(group, group[1:] + group[:1]):
                if self.node(a) != self.node(b):
                    leaving["inter_node"][self.node(a)] += 1
                if self.node_group(a) != self.node_group(b):
                    leaving["inter_group"][self.node_group(a)] += 1
        return {tier: max(count.values(), default=0) for tier, count in leaving.items()}


def _zero() -> dict[str, float]:
    return dict.fromkeys(TIERS, 0.0)


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends, by tier, for one optimizer step and for one shard sync."""

    rank: int
    """The rank."""
    step: dict[str, float] = field(default_factory=_zero)
    """Bytes sent by FSDP2's collectives (and HSDP's all-reduce) in one optimizer step, by tier."""
    sync: dict[str, float] = field(default_factory=_zero)
    """Bytes sent by one shard sync (every A steps; FL methods only), by tier."""
    A: int = 1
    """Optimizer steps between two syncs."""

    def per_step(self) -> dict[str, float]:
        """Bytes per optimizer step with the sync amortised: step + sync / A, by tier."""
        return {t: self.step[t] + self.sync[t] / self.A for t in TIERS}


def rank_traffic(method: str, placement: Placement, units: Units, *, rank: int, A: int = 1,
                 backend: Backend = "nccl", reshard_after_forward: bool = True, reshard_root: bool = False,
                 grad_ratio: float = 1.0, sync_ratio: float = 1.0, wire_ratio: float = 1.0) -> Traffic:
    """Bytes `rank` sends per optimizer step and per shard sync, by tier, with ring algorithms.

    Per unit and step: all-gather in forward and (blocks, if `reshard_after_forward`; root if `reshard_root`) in
    backward, u (S-1)/S each; reduce-scatter of gradients, u (S-1)/S (2 u (S-1)/S with gloo, which runs an
    all-reduce); hsdp/fl-hsdp: all-reduce of the gradient shard u/S over the replication group, 2 (u/S) (R-1)/R.
    Shard sync every A steps (F > 1): all-reduce of the rank's shards P/S over its federation group, 2 (P/S) (F-1)/F
    (fl-hsdp: replica r = 0 only), then fl-hsdp's broadcast from r = 0 along the chain r = 0, 1, ..., R-1 (pipelined:
    every rank but the last forwards P/S once). A ring runs over the group's ranks in rank order and rank i sends to
    the next one (the last to the first), so all of a rank's bytes for that collective go to that link's tier.
    `grad_ratio` / `sync_ratio` scale gradient and sync bytes against parameter bytes (e.g. 2 for bf16 parameters
    all-gathered but gradients reduced in fp32); `wire_ratio` scales the sync's cross-group all-reduce on top of
    that (its wire dtype against the shards': 0.5 for a bfloat16 sync of fp32 shards), not fl-hsdp's broadcast,
    which sends the shards' dtype.
    """
    check_layout(method, S=placement.S, R=placement.R, F=placement.F, A=A)
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    S, R, F = placement.S, placement.R, placement.F
    _, r, _ = placement.coords(rank)

    def out_tier(dim: str, ring: bool = True) -> Tier | None:
        group = placement.group(dim, rank)
        i = group.index(rank)
        if i == len(group) - 1 and not ring:
            return None  # last rank of a chain sends nothing
        return placement.link_tier(rank, group[(i + 1) % len(group)])

    step, sync = _zero(), _zero()
    if S > 1:
        gathers = sum(b * (2 if reshard_after_forward else 1) for b in units.blocks)
        gathers += units.root * (2 if reshard_root else 1)
        rs_factor = 2.0 if backend == "gloo" else 1.0
        step[out_tier("shard")] += (gathers + rs_factor * grad_ratio * units.total) * (S - 1) / S
    shard_bytes = units.total / S
    if method in ("hsdp", "fl-hsdp") and R > 1:
        step[out_tier("replica")] += 2 * shard_bytes * grad_ratio * (R - 1) / R
    if method.startswith("fl-") and F > 1:
        if method == "fl-fsdp" or r == 0:
            sync[out_tier("federation")] += 2 * shard_bytes * sync_ratio * wire_ratio * (F - 1) / F
        if method == "fl-hsdp" and R > 1:
            tier = out_tier("replica", ring=False)
            if tier is not None:
                sync[tier] += shard_bytes * sync_ratio
    return Traffic(rank=rank, step=step, sync=sync, A=A)


def traffic(method: str, placement: Placement, units: Units, *, A: int = 1, **options) -> list[Traffic]:
    """`rank_traffic` for every rank, in rank order (same options)."""
    return [rank_traffic(method, placement, units, rank=x, A=A, **options) for x in range(placement.world_size)]


# ---------------------------------------------------------------------------------------------------------------------
# Compute and memory.


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a decoder-only (Llama-like) transformer."""

    num_params: int
    """Total parameters."""
    num_layers: int
    """Transformer blocks: one FSDP2 unit each."""
    root_params: int
    """Parameters outside the blocks (embeddings, head, final norm): the root unit."""
    hidden_size: int
    """Model width h."""
    intermediate_size: int
    """MLP width i."""
    vocab_size: int
    """Vocabulary size (logits memory)."""
    name: str = "custom"
    """Label for reports."""

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "hidden_size", "intermediate_size", "vocab_size"):
            _positive_int(name, getattr(self, name))
        if not 0 <= self.root_params < self.num_params:
            raise ConfigError(f"root_params must be in [0, num_params), got {self.root_params}")

    @classmethod
    def from_counts(cls, num_params: int, num_layers: int, *, hidden_size: int | None = None,
                    vocab_size: int = 32000, name: str = "custom") -> ModelShape:
        """A model known only by its size: all parameters in the blocks; h from 12 h^2 params per block if not given."""
        _positive_int("num_params", num_params)
        _positive_int("num_layers", num_layers)
        h = hidden_size or max(1, round(math.sqrt(num_params / (12 * num_layers))))
        return cls(num_params=num_params, num_layers=num_layers, root_params=0, hidden_size=h,
                   intermediate_size=4 * h, vocab_size=vocab_size, name=name)

    def units(self, bytes_per_param: float) -> Units:
        """FSDP2 units in bytes: equal blocks and the root."""
        block = (self.num_params - self.root_params) / self.num_layers
        return Units(blocks=(block * bytes_per_param,) * self.num_layers, root=self.root_params * bytes_per_param)


def compute_time(num_params: float, tokens: float, flops_per_gpu: float, *,
                 flops_per_param_token: float = 6.0) -> float:
    """Seconds of compute for one GPU's batch: flops_per_param_token * params * tokens / achievable FLOP/s.

    6 = forward (2) + backward (4); 8 with activation checkpointing (forward recomputed). Ignores attention's
    quadratic term and counts the embedding lookup as a matmul (small, conservative).
    """
    if not flops_per_gpu > 0:
        raise ConfigError(f"flops_per_gpu must be positive, got {flops_per_gpu!r}")
    return flops_per_param_token * num_params * tokens / flops_per_gpu


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU during a training step."""

    states: float
    """Parameters, gradients and AdamW's two moments, sharded over S (replicated over R and F)."""
    gathered: float
    """Unsharded FSDP2 buffers: root unit + two blocks (current and prefetched), and one unit of full gradients."""
    activations: float
    """Saved activations of one batch (see `memory_per_gpu`)."""

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations


def memory_per_gpu(shape: ModelShape, *, S: int, tokens: int, bytes_per_param: float = 2.0,
                   state_bytes_per_param: float | None = None,
                   activation_checkpointing: bool = False) -> MemoryEstimate:
    """Estimate of the bytes one GPU holds: states / S + gathered buffers + activations.

    `state_bytes_per_param` defaults to 4 x `bytes_per_param` (parameter, gradient, exp_avg, exp_avg_sq in one
    dtype; use 16 for fp32 master weights with bf16 compute). Activations, in the compute dtype (`bytes_per_param`),
    per token: (9 h + 4 i) per block, 3 h outside the blocks, plus fp32 logits (4 bytes x vocab). Measured with
    saved-tensor hooks on Hugging Face's LlamaForCausalLM (sdpa attention, no dropout). With activation checkpointing
    only each block's input (h) is kept, plus one block's activations while it is recomputed.
    """
    _positive_int("S", S)
    _positive_int("tokens", tokens)
    state_bytes = 4 * bytes_per_param if state_bytes_per_param is None else state_bytes_per_param
    h, i, L = shape.hidden_size, shape.intermediate_size, shape.num_layers
    block = (shape.num_params - shape.root_params) / L
    gathered = 0.0
    if S > 1:
        gathered = bytes_per_param * (shape.root_params + 2 * block + max(shape.root_params, block))
    per_block = 9 * h + 4 * i
    kept = L * h + per_block if activation_checkpointing else L * per_block
    activations = tokens * ((kept + 3 * h) * bytes_per_param + 4 * shape.vocab_size)
    return MemoryEstimate(states=state_bytes * shape.num_params / S, gathered=gathered, activations=activations)
