"""The shard sync of groups that shard differently: bytes and time (docs/cost-model.md, "Unequal federations")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.sync_plan import Owners, SyncPlan, row_numel
from flwr_sharded_perf.costmodel import all_reduce_time, broadcast_time, positive_int
from flwr_sharded_perf.model_shape import ModelShape
from flwr_sharded_perf.traffic_report import ring_bytes_sent

Shapes = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class UnequalSync:
    """One shard sync of F groups with layouts (R_g, S_g): bytes and seconds, from the plan's channels."""

    layouts: tuple[tuple[int, int], ...]
    """(R_g, S_g) of every group, in member order."""
    channel_bytes: dict[Owners, float]
    """Wire bytes of each channel, in the plan's order."""
    rank_bytes: tuple[tuple[float, ...], ...]
    """[g][s]: bytes replica 0 of shard s of group g sends across groups per sync (its channels' all-reduces)."""
    broadcast_bytes: tuple[float, ...]
    """Per group: bytes its broadcast over R_g sends per sync, all replicas together (0 for R_g = 1)."""
    rank_time: tuple[tuple[float, ...], ...]
    """[g][s]: seconds from the sync's start until that shard's replicas hold the averaged shard."""
    busiest: float
    """Seconds of the busiest rank alone: its channels' all-reduces one after another, then its broadcast."""
    time: float
    """Seconds of the whole sync: the last rank's `rank_time` (on a shared uplink at least a group's bytes over it)."""

    @property
    def group_bytes(self) -> tuple[float, ...]:
        """Per group: bytes its ranks send across groups per sync."""
        return tuple(sum(row) for row in self.rank_bytes)

    @property
    def max_rank_bytes(self) -> float:
        """The most bytes one rank sends across groups per sync."""
        return max((b for row in self.rank_bytes for b in row), default=0.0)


def _checked_layouts(layouts: Sequence[tuple[int, int]], names: Sequence[str] | None) -> tuple[tuple[int, int], ...]:
    """The groups' (R, S) as a tuple; ConfigError naming the group unless each is a pair of integers >= 1."""
    if not layouts:
        raise ConfigError("layouts: a federation needs at least one group, got none")
    out = []
    for g, layout in enumerate(layouts):
        who = f"layouts[{g}]" + (f" (facility {names[g]})" if names else "")
        try:
            R, S = layout
        except (TypeError, ValueError):
            raise ConfigError(f"{who}: expected (R, S), got {layout!r}") from None
        for name, value in (("R", R), ("S", S)):
            positive_int(f"{who}: {name}", value)
        out.append((R, S))
    return tuple(out)


def _check_group_bandwidths(layouts: tuple[tuple[int, int], ...], B_F: float | None, B_R: list[float | None],
                            names: Sequence[str] | None) -> None:
    """ConfigError naming the bandwidth a sync of these groups needs but lacks (or gets not positive)."""
    if len(layouts) < 2:
        return
    needed = [("B_F", B_F, f"between the {len(layouts)} groups")]
    needed += [(f"B_R[{g}]" + (f" (facility {names[g]})" if names else ""), B_R[g], f"for its broadcast over R={R}")
               for g, (R, _) in enumerate(layouts) if R > 1]
    for name, value, why in needed:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{name}: a positive bandwidth in bits/s is required {why}, got {value!r}")


def coarse_shapes(model: ModelShape) -> Shapes:
    """A model's parameters coarsely: each block and the root as one 1-D tensor (cuts on elements, not rows)."""
    block = (model.num_params - model.root_params) // model.num_layers
    return ((block,),) * model.num_layers + (((model.root_params,),) if model.root_params else ())


def channel_elements(plan: SyncPlan) -> dict[Owners, int]:
    """Elements of each channel (its pieces'), in the plan's order."""
    out: dict[Owners, int] = {}
    for p in plan.pieces():
        out[p.owners] = out.get(p.owners, 0) + (p.end - p.start) * row_numel(plan.shapes[p.param])
    return {c: out[c] for c in plan.channels() if c in out}


def unequal_sync(layouts: Sequence[tuple[int, int]], shapes: Sequence[Sequence[int]] | None = None, *,
                 elements: int | None = None, bytes_per_param: float = 4.0, wire_ratio: float = 1.0,
                 B_F: float | None = None, B_R: Sequence[float | None] | None = None, shared_uplink: bool = False,
                 names: Sequence[str] | None = None) -> UnequalSync:
    """Bytes and seconds of one shard sync of groups with `layouts` (R_g, S_g), of a model's global `shapes` or
    `elements`; `B_F`: bits/s one flow between groups gets, `B_R[g]`: group g's replica bandwidth (R_g > 1)."""
    layouts = _checked_layouts(layouts, names)
    if (shapes is None) == (elements is None):
        raise ConfigError("give the model's parameter shapes or its element count, one of them")
    if elements is not None:
        positive_int("elements", elements)
        shapes = ((elements,),)
    for name, value in (("bytes_per_param", bytes_per_param), ("wire_ratio", wire_ratio)):
        if not value > 0:
            raise ConfigError(f"{name} must be positive, got {value!r}")
    F = len(layouts)
    B_R = list(B_R) if B_R is not None else [None] * F
    if len(B_R) != F:
        raise ConfigError(f"B_R: one bandwidth per group ({F}), got {len(B_R)}")
    _check_group_bandwidths(layouts, B_F, B_R, names)
    plan = SyncPlan(layouts=tuple(S for _, S in layouts), shapes=tuple(tuple(int(d) for d in s) for s in shapes))
    channels = {c: n * bytes_per_param * wire_ratio for c, n in channel_elements(plan).items()}
    rank_bytes, ready, serial = ([[0.0] * S for _, S in layouts] for _ in range(3))
    for owners, size in channels.items():
        seconds = all_reduce_time(size * 8, F, B_F) if F > 1 else 0.0
        start = max(ready[g][s] for g, s in enumerate(owners))
        for g, s in enumerate(owners):
            rank_bytes[g][s] += ring_bytes_sent("all_reduce", size, F)
            ready[g][s] = start + seconds
            serial[g][s] += seconds
    broadcast_bytes, busiest, rank_time = [], 0.0, []
    for g, (R, S) in enumerate(layouts):
        shards = [plan.shard_elements(g, s) * bytes_per_param for s in range(S)]
        broadcast_bytes.append(sum(shards) * (R - 1) if F > 1 else 0.0)
        cast = [broadcast_time(b * 8, R, B_R[g]) if F > 1 else 0.0 for b in shards]
        rank_time.append(tuple(ready[g][s] + cast[s] for s in range(S)))
        busiest = max(busiest, *(serial[g][s] + cast[s] for s in range(S)))
    time = max(max(row) for row in rank_time)
    if shared_uplink and F > 1:
        time = max(time, max(sum(row) for row in rank_bytes) * 8 / B_F)
    return UnequalSync(layouts=layouts, channel_bytes=channels, rank_bytes=tuple(tuple(r) for r in rank_bytes),
                       broadcast_bytes=tuple(broadcast_bytes), rank_time=tuple(rank_time), busiest=busiest,
                       time=time)

