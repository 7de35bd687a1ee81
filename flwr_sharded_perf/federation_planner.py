"""Plan a federation of facilities (docs/cost-model.md, "Planning a federation"): every combination of the
facilities' fitting layouts, their local steps (`planner.evaluate`), each one's A and the unequal groups' sync."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.schedule import idle_times, local_steps
from flwr_sharded_perf.cluster import Cluster, FacilityFederation
from flwr_sharded_perf.memory_model import GiB, MemoryBreakdown, StepOptions, memory_per_gpu
from flwr_sharded_perf.model_shape import ModelShape
from flwr_sharded_perf.planner import Candidate, check_aggregate_every, evaluate, layouts, planned_wire_ratio
from flwr_sharded_perf.unequal_sync_cost import UnequalSync, coarse_shapes, unequal_sync


@dataclass(frozen=True)
class FacilityPlan:
    """One facility's group in a federation plan."""

    name: str
    gpus: int
    local: Candidate
    """Its local step (fsdp or hsdp on its own GPUs, F = 1)."""
    memory: MemoryBreakdown
    """Bytes per GPU in the federation (F groups)."""
    A: int
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
        """Seconds from one sync until the last facility arrives at the next: max_g A_g t_g."""
        return max(f.A * f.local.step_time for f in self.facilities)

    @property
    def period(self) -> float:
        """Seconds per sync period: the last facility's local steps, then the sync."""
        return self.compute_period + self.sync.time

    @property
    def tokens_per_second(self) -> float:
        """sum_g A_g GPUs_g tokens per GPU over the period."""
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


def plan_federation(federation: FacilityFederation, model: ModelShape, *, tokens_per_gpu_batch: int = 4096,
                    aggregate_every: tuple[int, ...] = (1, 2, 4, 8, 16, 32), bytes_per_param: float = 2.0,
                    sync_bytes_per_param: float | None = None, memory_fraction: float = 0.9,
                    step: StepOptions | None = None, **options) -> list[FederationCandidate]:
    """Every combination of the facilities' fitting layouts, for every A, most tokens per second first."""
    F = len(federation.facilities)
    if not aggregate_every:
        raise ConfigError("--aggregate-every: give at least one value")
    check_aggregate_every(aggregate_every)
    per_facility = [facility_layouts(f, model, F, tokens_per_gpu_batch=tokens_per_gpu_batch,
                                     bytes_per_param=bytes_per_param, memory_fraction=memory_fraction, step=step,
                                     **options) for f in federation.facilities]
    wire = planned_wire_ratio(sync_bytes_per_param or bytes_per_param, bytes_per_param, F, step)
    out = []
    for combo in itertools.product(*per_facility):
        B_R = []
        for f, (c, _) in zip(federation.facilities, combo):
            tier = f.placement(1, c.R, c.S).dim_tier("replica")
            B_R.append(f.bandwidth[tier] if tier else None)
        sync = unequal_sync([(c.R, c.S) for c, _ in combo], coarse_shapes(model), bytes_per_param=bytes_per_param,
                            wire_ratio=wire, B_F=federation.inter_group, B_R=B_R, shared_uplink=federation.shared,
                            names=[f.name for f in federation.facilities])
        times = [c.step_time for c, _ in combo]
        for A in aggregate_every:
            steps = local_steps(A, times)
            plans = tuple(FacilityPlan(name=f.name, gpus=f.gpus, local=c, memory=m, A=a, idle=i, idle_equal=e)
                          for f, (c, m), a, i, e in zip(federation.facilities, combo, steps, idle_times(steps, times),
                                                         idle_times([A] * F, times)))
            out.append(FederationCandidate(facilities=plans, A=A, sync=sync, tokens_per_gpu=tokens_per_gpu_batch))
    return sorted(out, key=lambda c: (-c.tokens_per_second, c.A))
