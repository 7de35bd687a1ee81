"""The communication cost model (docs/cost-model.md): the paper's (`comm_terms`) and the calibrated one."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from flwr_sharded.config import METHODS
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.sites import SiteLayout

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


STAGING_BYTES = 4.0
"""Bytes per value of the sync's staging buffers (fp32), which the two-level scheme's in-site stage moves."""


def two_level_time(D: float, G: int, L: int, *, stage: float = 1.0, B_site: float | None,
                   B_cross: float | None) -> float:
    """Seconds of the two-level (site-aware) all-reduce of a shard of D bits on the wire among G sites of L members:
    C_RS(stage D, L) at B_site + C_AR(D / L, G) at B_cross + C_AG(stage D, L) at B_site (`stage`: the in-site stage's
    bytes over the wire's, fp32 staging / the wire's bytes); with G = 1 or L = 1 the flat ring C_AR(D, G L) at B_cross
    (B_site when G = 1). B_cross is one cross-site flow's bandwidth (L of them leave each site at once). The in-site
    reduce-scatter is a ring's on every backend (on gloo the sync runs its own: `ring.ring_reduce_scatter`)."""
    positive_int("G", G)
    positive_int("L", L)
    if G == 1 or L == 1:
        return all_reduce_time(D, G * L, B_cross if G > 1 else B_site)
    in_site = reduce_scatter_time(D * stage, L, B_site) + all_gather_time(D * stage, L, B_site)
    return in_site + all_reduce_time(D / L, G, B_cross)


def site_sync_time(shard_bytes: float, G: int, L: int, *, wire_bytes: float = 4.0, B_site: float | None,
                   B_cross: float | None) -> float:
    """`two_level_time` of a shard of `shard_bytes` in the wire's fp32 staging, `wire_bytes` per value on the wire
    (4: float32, 2: bfloat16, 1 + 4/256: int8)."""
    if not wire_bytes > 0:
        raise ConfigError(f"wire_bytes must be positive, got {wire_bytes!r}")
    return two_level_time(8 * shard_bytes * wire_bytes / STAGING_BYTES, G, L, stage=STAGING_BYTES / wire_bytes,
                          B_site=B_site, B_cross=B_cross)



@dataclass(frozen=True)
class SiteBytes:
    """Bytes one member sends in one sync of its shard, by level."""

    in_site: float
    """Over the fast tier, inside its site (the reduce-scatter and all-gather of the staged shard)."""
    cross: float
    """Over the slow tier, to another site."""


def site_sync_bytes(shard_bytes: float, G: int, L: int, *, wire_bytes: float = 4.0) -> SiteBytes:
    """A member's bytes per sync of a shard of `shard_bytes` (fp32 staging): two-level 2 (L-1)/L S in its site and
    2 (G-1)/G x S/L x wire_bytes/4 across; with G = 1 or L = 1 the flat ring's 2 (P-1)/P S wire_bytes/4, across sites
    when G > 1. A site's uplink carries what its members send across it."""
    positive_int("G", G)
    positive_int("L", L)
    wire = shard_bytes * wire_bytes / STAGING_BYTES
    if G == 1 or L == 1:
        flat = 2 * wire * (G * L - 1) / (G * L)
        return SiteBytes(in_site=0.0 if G > 1 else flat, cross=flat if G > 1 else 0.0)
    return SiteBytes(in_site=2 * shard_bytes * (L - 1) / L, cross=2 * wire / L * (G - 1) / G)


# ----- the sync protocol's exchanges (latency) ----------------------------------------------------------------------
SyncKind = Literal["blocking", "overlapped"]
Collective = Literal["all_gather", "all_reduce"]

RING_STEPS: dict[str, int] = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
"""Sequential steps of a ring collective among n members, in units of n - 1 (each step waits for its slowest hop)."""


def ring_steps(collective: str, n: int) -> int:
    """Sequential steps of a ring `collective` among n members: n - 1, 2 (n - 1) for an all-reduce; 0 for n = 1."""
    positive_int("n", n)
    return RING_STEPS[collective] * (n - 1)


@dataclass(frozen=True)
class Exchange:
    """One exchange between the members in a fragment sync, besides its reduction."""

    name: str
    collective: Collective
    code: str
    """Where the runtime issues it."""


PROTOCOL: dict[SyncKind, tuple[Exchange, ...]] = {
    "overlapped": (Exchange("admission", "all_gather", "parallel.admission.admit (sync_verdict.admit_channels)"),
                   Exchange("result vote", "all_reduce", "parallel.admission.vote (sync_verdict.conclude)")),
    "blocking": (Exchange("admission", "all_gather", "parallel.admission.admit (sync_verdict.admit_channels)"),
                 Exchange("result vote", "all_reduce", "parallel.admission.vote (sync_verdict.conclude)"),
                 Exchange("commit vote", "all_gather", "parallel.admission.commit_vote (Commits.agree)")),
}
"""The exchanges between the members of one fragment sync besides its reduction, by kind of sync, each over all n
members (one channel: equal groups), all in sequence with the reduction; the one table every count derives from.

| exchange | collective | steps | overlapped | blocking |
|---|---|---|---|---|
| admission (weights, verdicts, adopted merges) | all-gather | n - 1 | 1 | 1 |
| the reduction, one per unit (`reduction_steps`) | all-reduce | 2 (n - 1); two-level: 2 (G - 1) across | c | c |
| result vote | all-reduce (MIN) | 2 (n - 1) | 1 | 1 |
| commit vote | all-gather | n - 1 | 0 | 1 |

An overlapped sync's commit is confirmed by the next admission (docs/flower.md, "Commit without lock-step").
Not counted (not between sites, or not per sync): the flags inside a member's group, the first sync's alignment
check, the round's rendezvous, `confirm_merges` at a run's end."""


def protocol_steps(kind: SyncKind, n: int) -> int:
    """Sequential steps of one fragment sync's exchanges besides its reduction (`PROTOCOL`): 3 (n-1) overlapped,
    4 (n-1) blocking."""
    if kind not in PROTOCOL:
        raise ConfigError(f"sync kind must be one of {', '.join(PROTOCOL)}, got {kind!r}")
    return sum(ring_steps(e.collective, n) for e in PROTOCOL[kind])


def reduction_steps(n: int, collectives: float = 1, sites: SiteLayout | None = None) -> tuple[float, float]:
    """Sequential steps of a fragment sync's reduction among n members, (on the federation's slowest tier, inside
    the sites): `collectives` x 2 (n-1) flat; two-level x 2 (G-1) across and x 2 (L-1) inside."""
    if sites is None or not sites.two_level:
        return collectives * ring_steps("all_reduce", n), 0.0
    if sites.members != n:
        raise ConfigError(f"sites place {sites.members} members, the federation group has {n}")
    return (collectives * ring_steps("all_reduce", sites.G),
            collectives * (ring_steps("reduce_scatter", sites.L) + ring_steps("all_gather", sites.L)))


@dataclass(frozen=True)
class FragmentSync:
    """One fragment sync among `members`, to price at a latency: its bytes' seconds and its sequential steps."""

    kind: SyncKind
    members: int
    data: float
    """Seconds of its bytes (the bandwidth terms, blocking)."""
    collectives: float
    """Collectives of its reduction (one per unit of the fragment)."""
    sites: SiteLayout | None = None
    alpha_site: float = 0.0
    """Seconds per step inside a site (the two-level scheme's in-site stage)."""
    steps: int | None = None
    """Steps of one reduction collective across sites (NCCL's tree: `allreduce_steps`); None: `reduction_steps`'."""

    def reduction(self, alpha: float) -> float:
        """Seconds of its reduction's steps at `alpha` per step across sites."""
        cross, in_site = reduction_steps(self.members, self.collectives, self.sites)
        cross = cross if self.steps is None else self.collectives * self.steps
        return cross * alpha + in_site * self.alpha_site

    def protocol(self, alpha: float) -> float:
        """Seconds of its other exchanges' steps at `alpha` per step (`protocol_steps`)."""
        return protocol_steps(self.kind, self.members) * alpha

    def time(self, alpha: float) -> float:
        return self.data + self.reduction(alpha) + self.protocol(alpha)

    def protocol_share(self, alpha: float) -> float:
        """The exchanges' share of the fragment sync's time at `alpha` per step."""
        total = self.time(alpha)
        return self.protocol(alpha) / total if total > 0 else 0.0


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
    protocol: float = 0.0
    """Seconds of the sync protocol's other exchanges (`PROTOCOL`: admission, votes), amortised over A; 0 unless
    `comm_terms(protocol=...)`. An overlapped sync's thread runs them with its reduction: `overlapped` moves them
    into `sync` and `hidden`."""

    @property
    def total(self) -> float:
        return self.shard + self.replicate + self.sync + self.latency + self.protocol


def overlapped(terms: CommTerms, *, A: int, fragments: int = 1, delay: int = 0, local_step: float) -> CommTerms:
    """`terms` with an overlapped sync (`--sync-fragments` N, `--sync-delay` tau): exposed sync = N max(0, sync A / N
    - tau local_step) / A, the rest `hidden`; the protocol's exchanges travel with the sync (`CommTerms.protocol`)."""
    for name, value in (("A", A), ("fragments", fragments)):
        positive_int(name, value)
    if delay < 0 or not local_step >= 0:
        raise ConfigError(f"delay and local_step must be >= 0, got {delay!r} and {local_step!r}")
    if delay == 0:
        return terms
    per_fragment = (terms.sync + terms.protocol) * A / fragments
    exposed = max(0.0, per_fragment - delay * local_step) * fragments / A
    return replace(terms, sync=exposed, protocol=0.0, hidden=terms.sync + terms.protocol - exposed)


def comm_terms(method: str, units: Units, *, S: int, R: int = 1, F: int = 1, A: int = 1, B_S: float | None,
               B_R: float | None = None, B_F: float | None = None, sizes: Sizes = "exact", backend: Backend = "nccl",
               reshard_after_forward: bool = True, reshard_root: bool = False, alpha_S: float = 0.0,
               alpha_R: float = 0.0, alpha_F: float = 0.0, wire_ratio: float = 1.0, steps_R: int | None = None,
               steps_F: int | None = None, sites: SiteLayout | None = None, B_site: float | None = None,
               alpha_site: float = 0.0, stage_ratio: float | None = None, protocol: SyncKind | None = None,
               fragments: int = 1) -> CommTerms:
    """Communication seconds per optimizer step by kind, with Eqs. 1-5's one message size (`sizes="paper"`) or each
    collective's own (docs/cost-model.md); `alpha_*`: seconds per sequential step of a collective, `steps_R` /
    `steps_F`: an all-reduce's steps (None: the ring's); `wire_ratio`: the sync's wire bytes over the units'.
    `sites`: the F members' sites, a two-level sync (`two_level_time`: B_F and alpha_F across sites, B_site and
    alpha_site inside; `stage_ratio`: its in-site stage's bytes over the units', None: `wire_ratio`); None: the flat
    ring. `protocol`: count the `fragments` syncs' other exchanges of that kind at alpha_F (`protocol_steps`)."""
    check_layout(method, S=S, R=R, F=F, A=A)
    _check_bandwidths(method, S, R, F, B_S, B_R, B_F)
    if sizes not in ("exact", "paper"):
        raise ConfigError(f"sizes must be 'exact' or 'paper', got {sizes!r}")
    check_backend(backend)
    if not wire_ratio > 0:
        raise ConfigError(f"wire_ratio must be positive, got {wire_ratio!r}")
    hsdp = method in ("hsdp", "fl-hsdp")
    syncs = method.startswith("fl-") and F > 1
    if sites is not None and sites.members != F:
        raise ConfigError(f"sites place {sites.members} members, the layout has F={F}")
    two_level = syncs and sites is not None and sites.two_level
    if two_level:
        _check_bandwidth("B_site", B_site, True, "by a two-level sync")
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
    if two_level:
        stage = (wire_ratio if stage_ratio is None else stage_ratio) / wire_ratio
        reduced = sum(two_level_time(D * wire_ratio, sites.G, sites.L, stage=stage, B_site=B_site, B_cross=B_F)
                      for D in shard_msgs)
    else:
        reduced = sum(all_reduce_time(D * wire_ratio, F, B_F) for D in shard_msgs)
    sync = (reduced + broadcast) / A if syncs else 0.0
    n_units = len(shard_msgs)
    steps_R = ring_steps("all_reduce", R) if steps_R is None else steps_R
    cross_steps, site_steps = reduction_steps(F, 1, sites if two_level else None)
    steps_F = cross_steps if steps_F is None else steps_F
    latency = (sum(k for k, _ in gathers) + len(reduces)) * (S - 1) * alpha_S + n_units * steps_R * alpha_R * hsdp
    sync_latency = n_units * (steps_F * alpha_F + site_steps * alpha_site
                              + (R - 1 if method == "fl-hsdp" else 0) * alpha_R) / A if syncs else 0.0
    positive_int("fragments", fragments)
    exchanges = fragments * protocol_steps(protocol, F) * alpha_F / A if syncs and protocol is not None else 0.0
    # the forward gathers every unit once: its share of the all-gathers' time and steps
    forward = sum(all_gather_time(D, S, B_S) for _, D in gathers) + len(gathers) * (S - 1) * alpha_S
    return CommTerms(shard=shard, replicate=replicate, sync=sync, latency=latency + sync_latency, forward=forward,
                     sync_latency=sync_latency, protocol=exchanges)


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
    ring = ring_steps("all_reduce", n)
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
