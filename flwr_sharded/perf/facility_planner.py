"""Plan a federation of facilities of different sizes: each facility's (R, S), its local steps per sync, its idle time.

Every facility is one FL group on all its GPUs. For each facility the planner's own `evaluate` predicts the local
step of every (R, S) with R x S = its GPUs (S dividing a node or made of whole nodes, as `planner.layouts`) on its own
GPUs and tiers, and `memory_model` its memory in a federation of F groups. For every combination of the facilities'
fitting layouts and every A, the fastest facility runs A local steps per sync and facility g runs
A_g = max(1, round(A t_fastest / t_g)) (`training.pace.local_steps`), so that all arrive at the sync together; each waits for the
last (`idle_times`), then the sync (`unequal_sync_cost.unequal_sync`) runs. Combinations rank by tokens per second over the
federation: sum_g A_g x GPUs_g x tokens per GPU, over the period max_g (A_g t_g) + the sync's time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from flwr_sharded.errors import ConfigError
from flwr_sharded.perf.cluster import Cluster, FacilityFederation
from flwr_sharded.perf.memory_model import MemoryBreakdown, StepOptions, memory_per_gpu
from flwr_sharded.perf.model_shape import ModelShape
from flwr_sharded.perf.planner import Candidate, _wire_ratio, evaluate, layouts
from flwr_sharded.perf.unequal_sync_cost import UnequalSync, coarse_shapes, unequal_sync
from flwr_sharded.training.pace import idle_times, local_steps

GiB = 1024**3


def _check_steps(A: int) -> None:
    if isinstance(A, bool) or not isinstance(A, int) or A < 1:
        raise ConfigError(f"--aggregate-every: values must be integers >= 1, got {A!r}")


@dataclass(frozen=True)
class FacilityPlan:
    """One facility's group in a federation plan."""

    name: str
    gpus: int
    local: Candidate
    """Its local step (fsdp or hsdp on its own GPUs, F = 1: compute, shard and replica communication)."""
    memory: MemoryBreakdown
    """Bytes per GPU in the federation (F groups)."""
    A: int
    """Local steps per sync (`training.pace.local_steps`)."""
    idle: float
    """Seconds it waits per sync for the others, with its own A."""
    idle_equal: float
    """Seconds it would wait per sync if every facility ran the fastest one's A."""

    @property
    def R(self) -> int:
        return self.local.R

    @property
    def S(self) -> int:
        return self.local.S


@dataclass(frozen=True)
class FederationCandidate:
    """A federation's layouts, local steps and sync, with its predicted throughput."""

    facilities: tuple[FacilityPlan, ...]
    A: int
    """Local steps per sync of the fastest facility."""
    sync: UnequalSync
    tokens_per_gpu: int

    @property
    def compute_period(self) -> float:
        """Seconds from one sync to the next facility's arrival at the following one: max_g A_g t_g."""
        return max(f.A * f.local.step_time for f in self.facilities)

    @property
    def period(self) -> float:
        """Seconds per sync period: the last facility's local steps, then the sync."""
        return self.compute_period + self.sync.time

    @property
    def tokens_per_second(self) -> float:
        """Tokens the federation trains on per second: sum_g A_g GPUs_g tokens per GPU over the period."""
        return sum(f.A * f.gpus for f in self.facilities) * self.tokens_per_gpu / self.period

    def label(self) -> str:
        return ", ".join(f"{f.name} R={f.R} S={f.S} A={f.A}" for f in self.facilities)


def facility_layouts(facility: Cluster, model: ModelShape, F: int, *, tokens_per_gpu_batch: int,
                     bytes_per_param: float, memory_fraction: float, step: StepOptions | None,
                     **options) -> list[tuple[Candidate, MemoryBreakdown]]:
    """Every (R, S) of one facility that fits in memory in a federation of F groups, with its local step."""
    out, smallest = [], None
    for method, _, R, S, _ in layouts(facility.gpus, facility.gpus_per_node, ("fsdp", "hsdp")):
        local = evaluate(facility, model, method, R=R, S=S, tokens_per_gpu_batch=tokens_per_gpu_batch,
                         bytes_per_param=bytes_per_param, memory_fraction=memory_fraction, step=step, **options)
        memory = memory_per_gpu(model, S=S, R=R, F=F, tokens=tokens_per_gpu_batch, bytes_per_param=bytes_per_param,
                                state_bytes_per_param=options.get("state_bytes_per_param"),
                                activation_checkpointing=options.get("activation_checkpointing", False),
                                options=step)
        if memory.total <= memory_fraction * facility.gpu_memory:
            out.append((local, memory))
        elif smallest is None or memory.total < smallest[1]:
            smallest = (S, memory.total)
    if not out:
        raise ConfigError(f"facility {facility.name}: no sharding degree S of its {facility.gpus} GPUs fits "
                          f"{memory_fraction:.0%} of {facility.gpu_memory / GiB:.1f} GiB per GPU (S={smallest[0]} "
                          f"needs {smallest[1] / GiB:.1f} GiB); try --activation-checkpointing, fewer "
                          f"--tokens-per-gpu or more GPUs there")
    return out


def _replica_bandwidth(facility: Cluster, R: int, S: int) -> float | None:
    tier = facility.placement(1, R, S).dim_tier("replica")
    return facility.bandwidth[tier] if tier else None


def plan_federation(federation: FacilityFederation, model: ModelShape, *, tokens_per_gpu_batch: int = 4096,
                    aggregate_every: tuple[int, ...] = (1, 2, 4, 8, 16, 32), bytes_per_param: float = 2.0,
                    sync_bytes_per_param: float | None = None, memory_fraction: float = 0.9,
                    step: StepOptions | None = None, **options) -> list[FederationCandidate]:
    """Every combination of the facilities' fitting layouts, for every A, best (most tokens per second) first.

    `options`: `evaluate`'s (`sizes`, `latency`, `activation_checkpointing`, `state_bytes_per_param`). The sync
    moves `sync_bytes_per_param` (None: `bytes_per_param`) per value through the wire `step.sync_topk` names,
    scaled as the planner's (`planner._wire_ratio`); a facility where nothing fits is a ConfigError naming it.
    """
    F = len(federation.facilities)
    if not aggregate_every:
        raise ConfigError("--aggregate-every: give at least one value")
    for A in aggregate_every:
        _check_steps(A)
    per_facility = [facility_layouts(f, model, F, tokens_per_gpu_batch=tokens_per_gpu_batch,
                                     bytes_per_param=bytes_per_param, memory_fraction=memory_fraction, step=step,
                                     **options) for f in federation.facilities]
    sync_bytes = sync_bytes_per_param or bytes_per_param
    wire = _wire_ratio(sync_bytes, bytes_per_param, F, step)
    shapes = coarse_shapes(model)
    names = [f.name for f in federation.facilities]
    out = []
    for combo in itertools.product(*per_facility):
        sync = unequal_sync([(c.R, c.S) for c, _ in combo], shapes, bytes_per_param=bytes_per_param,
                            wire_ratio=wire, B_F=federation.inter_group,
                            B_R=[_replica_bandwidth(f, c.R, c.S) for f, (c, _) in zip(federation.facilities, combo)],
                            shared_uplink=federation.shared, names=names)
        times = [c.step_time for c, _ in combo]
        for A in aggregate_every:
            steps = local_steps(A, times)
            idle = idle_times(steps, times)
            idle_equal = idle_times([A] * F, times)
            plans = tuple(FacilityPlan(name=f.name, gpus=f.gpus, local=c, memory=m, A=a, idle=i, idle_equal=e)
                          for f, (c, m), a, i, e in zip(federation.facilities, combo, steps, idle, idle_equal))
            out.append(FederationCandidate(facilities=plans, A=A, sync=sync, tokens_per_gpu=tokens_per_gpu_batch))
    return sorted(out, key=lambda c: (-c.tokens_per_second, c.A))

