"""Where the ranks of an F x R x S mesh run on a tiered cluster, and the bytes each rank sends per tier."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.sites import SiteLayout
from flwr_sharded_perf.costmodel import (STAGING_BYTES, Backend, Units, check_backend, check_layout, positive_int,
                                         site_sync_bytes)

TIERS = ("intra_node", "inter_node", "inter_group")
"""Network tiers, fastest first: same node, same node group (rack, cell, facility), different groups."""
Tier = Literal["intra_node", "inter_node", "inter_group"]

DIMENSIONS = ("shard", "replica", "federation")
"""Mesh dimensions: sharding group (S ranks), replication group (R), federation group (F)."""


@dataclass(frozen=True)
class Placement:
    """Where the ranks of an F x R x S mesh run: rank = f*R*S + r*S + s, filling nodes, then node groups, in order."""

    F: int
    R: int
    S: int
    gpus_per_node: int
    """Ranks (GPUs) per node: node = rank // gpus_per_node."""
    nodes_per_group: int | None = None
    """Nodes per node group (rack, cell, facility): group = node // nodes_per_group; None: a single group."""

    def __post_init__(self) -> None:
        for name in ("F", "R", "S", "gpus_per_node"):
            positive_int(name, getattr(self, name))
        if self.nodes_per_group is not None:
            positive_int("nodes_per_group", self.nodes_per_group)

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
        return max((self.link_tier(ranks[0], x) for x in ranks[1:]), key=TIERS.index, default=None)

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
        """Slowest tier the groups of a dimension (or of `ranks`) span (the paper's B_S, B_R, B_F); None for size 1."""
        return self.rings_tier(self.groups(dim, ranks))

    def rings_tier(self, rings: Sequence[Sequence[int]]) -> Tier | None:
        """Slowest tier that any of `rings` (lists of ranks) spans; None if each is a single rank."""
        tiers = {self.span_tier(g) for g in rings}
        tiers.discard(None)
        return max(tiers, key=TIERS.index) if tiers else None

    def flows(self, dim: str, ranks: Sequence[int] | None = None) -> dict[str, int]:
        """Most ring edges leaving one node or node group when all groups of a dimension (or of `ranks`) run at once."""
        return self.ring_flows(self.groups(dim, ranks))

    def ring_flows(self, rings: Sequence[Sequence[int]]) -> dict[str, int]:
        """Most ring edges leaving one node or node group when all `rings` (ranks in ring order) run at once."""
        leaving: dict[str, Counter] = {"inter_node": Counter(), "inter_group": Counter()}
        for group in (list(g) for g in rings):
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


def rank_traffic(method: str, placement: Placement, units: Units, *, rank: int, A: int = 1,
                 backend: Backend = "nccl", reshard_after_forward: bool = True, reshard_root: bool = False,
                 grad_ratio: float = 1.0, sync_ratio: float = 1.0, wire_ratio: float = 1.0,
                 sites: SiteLayout | None = None, stage_ratio: float | None = None) -> Traffic:
    """Bytes `rank` sends per optimizer step and per shard sync, by tier (docs/cost-model.md, "Bytes per tier");
    `grad_ratio` / `sync_ratio` scale gradient and sync bytes, `wire_ratio` the sync's all-reduce on top. `sites`:
    the F members' sites, a two-level sync (`site_sync_bytes`; `stage_ratio`: its in-site stage's bytes over the
    units', None: `wire_ratio`); None: the flat ring."""
    check_layout(method, S=placement.S, R=placement.R, F=placement.F, A=A)
    check_backend(backend)
    S, R, F = placement.S, placement.R, placement.F
    f, r, s = placement.coords(rank)
    if sites is not None and sites.members != F:
        raise ConfigError(f"sites place {sites.members} members, the layout has F={F}")

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
        if (method == "fl-fsdp" or r == 0) and (sites is None or not sites.two_level):
            sync[out_tier("federation")] += 2 * shard_bytes * sync_ratio * wire_ratio * (F - 1) / F
        elif method == "fl-fsdp" or r == 0:
            stage = wire_ratio if stage_ratio is None else stage_ratio
            sent = site_sync_bytes(shard_bytes * sync_ratio * stage, sites.G, sites.L,
                                   wire_bytes=STAGING_BYTES * wire_ratio / stage)
            for rings, nbytes in ((sites.site_rings(), sent.in_site), (sites.cross_rings(), sent.cross)):
                ring = next(g for g in rings if f in g)
                peer = placement.rank(ring[(ring.index(f) + 1) % len(ring)], r, s)
                sync[placement.link_tier(rank, peer)] += nbytes
        if method == "fl-hsdp" and R > 1:
            tier = out_tier("replica", ring=False)
            if tier is not None:
                sync[tier] += shard_bytes * sync_ratio
    return Traffic(rank=rank, step=step, sync=sync, A=A)


def traffic(method: str, placement: Placement, units: Units, *, A: int = 1, **options) -> list[Traffic]:
    """`rank_traffic` for every rank, in rank order (same options)."""
    return [rank_traffic(method, placement, units, rank=x, A=A, **options) for x in range(placement.world_size)]
