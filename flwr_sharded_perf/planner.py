"""Rank the (method, F, R, S, A) layouts of a cluster with the cost model (docs/cost-model.md, "Planner"); a
federation of facilities: `federation_planner`; the command line of both: `plan_cli`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Union

from flwr_sharded.config import METHODS
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.sites import SiteLayout
from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES, wire_ratio
from flwr_sharded_perf.cluster import Cluster
from flwr_sharded_perf.costmodel import (ADAMW_BYTES_PER_PARAM, SGD_BYTES_PER_PARAM, STAGING_BYTES, Calibration,
                                         CommTerms, FragmentSync, Phases, allreduce_steps, check_layout, comm_terms,
                                         flow_bandwidth, optimizer_time, overlapped, phase_time, positive_int)
from flwr_sharded_perf.memory_model import MemoryBreakdown, StepOptions, memory_per_gpu
from flwr_sharded_perf.model_shape import ModelShape, compute_time, model_from_preset
from flwr_sharded_perf.placement import DIMENSIONS, Placement


@dataclass(frozen=True)
class Candidate:
    """One layout with its predicted cost per optimizer step."""

    method: str
    F: int
    R: int
    S: int
    A: int
    """Optimizer steps between shard syncs (1 for fsdp/hsdp)."""
    tiers: dict[str, str | None]
    """Slowest tier each mesh dimension spans (shard, replica, federation); None if the dimension has size 1."""
    bandwidth: dict[str, float | None]
    """Bits/s one flow of each dimension's collectives gets: its tier's, divided among flows on a shared uplink."""
    comm: CommTerms
    compute: float
    memory: MemoryBreakdown
    """Bytes per GPU (the trainer's, `memory_model`); `memory.total` is the step's peak."""
    batch_tokens: int
    """Effective batch of one optimizer step of one model: all GPUs for fsdp/hsdp, one group (R x S GPUs) for FL."""
    fits: bool
    """Whether `memory` fits the usable GPU memory."""
    phases: Phases | None = None
    calibrated: bool = False
    """Predicted with the cluster's calibrated model: then the step is the sum of `phases`."""
    fragment_sync: FragmentSync | None = None
    """One of its fragment syncs, to price at a latency (FL with F > 1)."""

    @property
    def step_time(self) -> float:
        """Predicted seconds per optimizer step: compute + communication, or calibrated, the sum of the phases."""
        if self.calibrated and self.phases is not None:
            return self.phases.total
        return self.compute + self.comm.total

    @property
    def federated(self) -> bool:
        return self.method.startswith("fl-")

    def label(self) -> str:
        return f"{self.method} F={self.F} R={self.R} S={self.S} A={self.A}"


def layouts(gpus: int, gpus_per_node: int, methods: tuple[str, ...] = METHODS,
            aggregate_every: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> list[tuple[str, int, int, int, int]]:
    """All (method, F, R, S, A) with F*R*S = gpus and S dividing a node or made of whole nodes."""
    out = []
    for S in (d for d in range(1, gpus + 1) if gpus % d == 0 and not (gpus_per_node % d and d % gpus_per_node)):
        rest = gpus // S
        for F in (d for d in range(1, rest + 1) if rest % d == 0):
            method = ("fl-" if F > 1 else "") + ("hsdp" if rest // F > 1 else "fsdp")
            if method in methods:
                out += [(method, F, rest // F, S, A) for A in (aggregate_every if F > 1 else (1,))]
    return out


def check_aggregate_every(values: tuple[int, ...]) -> None:
    """ConfigError naming `--aggregate-every` unless every value is an integer >= 1."""
    for A in values:
        if isinstance(A, bool) or not isinstance(A, int) or A < 1:
            raise ConfigError(f"--aggregate-every: values must be integers >= 1, got {A!r}")


SitesSpec = Union[SiteLayout, Sequence[int], Literal["groups"], None]
"""The federation members' sites: `SiteLayout`, a list member index -> site, "groups" (each member's node group of the
cluster), or None (the flat ring)."""


def layout_sites(placement: Placement, spec: SitesSpec) -> SiteLayout | None:
    """The sites of the F members of `placement`; "groups": None where a member spans node groups or the groups hold
    unequal numbers of members (the flat ring)."""
    if spec is None or isinstance(spec, SiteLayout):
        return spec
    if spec != "groups":
        return SiteLayout(tuple(spec))
    site_of = []
    for f in range(placement.F):
        groups = {placement.node_group(placement.rank(f, r, s)) for r in range(placement.R) for s in range(placement.S)}
        if len(groups) > 1:
            return None
        site_of += groups
    try:
        return SiteLayout(tuple(site_of))
    except ConfigError:
        return None


def planned_wire_ratio(sync_bytes: float, bytes_per_param: float, F: int, step: StepOptions | None) -> float:
    """The sync's wire bytes per parameter over the units' (`parallel.wire.wire_ratio`; `F`: the members whose rows a
    top-k sync all-gathers, the G sites' in two levels)."""
    return wire_ratio(sync_bytes, step.sync_topk if step is not None else None, F, over=bytes_per_param)


def evaluate(cluster: Cluster, model: ModelShape, method: str, *, F: int = 1, R: int = 1, S: int, A: int = 1,
             tokens_per_gpu_batch: int = 4096, bytes_per_param: float = 2.0,
             state_bytes_per_param: float | None = None, sizes: str = "exact", latency: bool = False,
             activation_checkpointing: bool = False, memory_fraction: float = 0.9,
             sync_bytes_per_param: float | None = None, step: StepOptions | None = None, sites: SitesSpec = None,
             protocol: bool = False) -> Candidate:
    """Predict one layout's step on `cluster` (the options are `flwr-sharded plan`'s); `sync_bytes_per_param`: the FL
    sync's (None: `bytes_per_param`, and the trainer's float32 sync); `step`: the trainer's options, an overlapped
    sync's included; `sites`: the members' sites, a two-level sync (`layout_sites`; its in-site stage in fp32 with a
    `sync_bytes_per_param`, else in `bytes_per_param`); `protocol`: count the sync's other exchanges
    (`costmodel.PROTOCOL`) at the federation's latency."""
    _check_evaluation(cluster, method, F=F, R=R, S=S, A=A, tokens_per_gpu_batch=tokens_per_gpu_batch,
                      memory_fraction=memory_fraction, sync_bytes_per_param=sync_bytes_per_param)
    calibrated = cluster.calibration is not None and sizes == "exact"
    placement = cluster.placement(F, R, S)
    tiers, bw, steps = _dimension_links(cluster, placement, method, calibrated)
    step = step or StepOptions()
    syncs = method.startswith("fl-") and F > 1
    two_level = layout_sites(placement, sites) if syncs else None
    site_tier, B_site = None, None
    if two_level is not None and two_level.two_level:
        cal = cluster.calibration if calibrated else None
        rings = [[[placement.rank(f, 0, s) for f in ring] for s in range(S) for ring in rs]
                 for rs in (two_level.cross_rings(), two_level.site_rings())]
        tiers["federation"], bw["federation"], steps["federation"] = _ring_link(cluster, placement, rings[0], cal)
        site_tier, B_site, _ = _ring_link(cluster, placement, rings[1], cal)
    alpha = {dim: (cluster.latency[t] if t and (latency or calibrated) else 0.0) for dim, t in tiers.items()}
    alpha_site = cluster.latency[site_tier] if site_tier and (latency or calibrated) else 0.0
    units = model.units(bytes_per_param)
    kind = "overlapped" if step.sync_delay > 0 else "blocking"
    comm = comm_terms(method, units, S=S, R=R, F=F, A=A, B_S=bw["shard"],
                      B_R=bw["replica"], B_F=bw["federation"], sizes=sizes, backend=cluster.backend,
                      alpha_S=alpha["shard"], alpha_R=alpha["replica"], alpha_F=alpha["federation"],
                      wire_ratio=planned_wire_ratio(sync_bytes_per_param or bytes_per_param, bytes_per_param,
                                                    two_level.G if two_level is not None and two_level.two_level
                                                    else F, step),
                      steps_R=steps["replica"], steps_F=steps["federation"], sites=two_level, B_site=B_site,
                      alpha_site=alpha_site,
                      stage_ratio=None if sync_bytes_per_param is None and step.sync_topk is None
                      else STAGING_BYTES / bytes_per_param,  # a top-k sync stages its fp32 deltas in the site
                      protocol=kind if protocol else None, fragments=step.sync_fragments)
    fragment = FragmentSync(kind=kind, members=F, data=comm.sync * A / step.sync_fragments,
                            collectives=units.count / step.sync_fragments,
                            sites=two_level if two_level is not None and two_level.two_level else None,
                            alpha_site=alpha_site, steps=steps["federation"]) if syncs else None
    flops_per_param_token = 8.0 if activation_checkpointing else 6.0
    compute = compute_time(model.compute_params, tokens_per_gpu_batch, cluster.flops_per_gpu,
                           flops_per_param_token=flops_per_param_token)
    overlap = calibrated and cluster.calibration.overlap
    forward_compute = compute * 2.0 / flops_per_param_token
    forward = phase_time(forward_compute, comm.forward, overlap)
    backward = phase_time(compute - forward_compute,
                          comm.total - comm.sync - comm.sync_latency - comm.protocol - comm.forward, overlap)
    if method.startswith("fl-"):
        local_step = forward + backward if calibrated else compute + comm.shard + comm.replicate
        comm = overlapped(comm, A=A, fragments=step.sync_fragments, delay=step.sync_delay, local_step=local_step)
    opt_bytes = ADAMW_BYTES_PER_PARAM if step.optimizer == "adamw" else SGD_BYTES_PER_PARAM
    optimizer = optimizer_time(model.num_params / S, opt_bytes,
                               cluster.calibration.memory_bandwidth if calibrated else 0.0)
    phases = Phases(forward=forward, backward=backward, optimizer=optimizer,
                    aggregation=comm.sync + comm.sync_latency + comm.protocol)
    memory = memory_per_gpu(model, S=S, R=R, F=F, tokens=tokens_per_gpu_batch, bytes_per_param=bytes_per_param,
                            state_bytes_per_param=state_bytes_per_param,
                            activation_checkpointing=activation_checkpointing,
                            options=_with_sync_dtype(step, sync_bytes_per_param))
    group_gpus = R * S if method.startswith("fl-") else cluster.gpus
    return Candidate(method=method, F=F, R=R, S=S, A=A, tiers=tiers, bandwidth=bw, comm=comm, compute=compute,
                     memory=memory, batch_tokens=group_gpus * tokens_per_gpu_batch,
                     fits=memory.total <= memory_fraction * cluster.gpu_memory, phases=phases, calibrated=calibrated,
                     fragment_sync=fragment)


def _check_evaluation(cluster: Cluster, method: str, *, F: int, R: int, S: int, A: int, tokens_per_gpu_batch: int,
                      memory_fraction: float, sync_bytes_per_param: float | None) -> None:
    """ConfigError naming the first of `evaluate`'s arguments that is out of range."""
    check_layout(method, S=S, R=R, F=F, A=A)
    positive_int("tokens_per_gpu_batch", tokens_per_gpu_batch)
    if not 0 < memory_fraction <= 1:
        raise ConfigError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if sync_bytes_per_param is not None and not sync_bytes_per_param > 0:
        raise ConfigError(f"sync_bytes_per_param must be positive, got {sync_bytes_per_param!r}")
    if F * R * S != cluster.gpus:
        raise ConfigError(f"layout F={F} x R={R} x S={S} = {F * R * S} ranks, but the cluster has {cluster.gpus} GPUs")


def _with_sync_dtype(step: StepOptions, sync_bytes_per_param: float | None) -> StepOptions:
    """`step` with the sync dtype of `sync_bytes_per_param` bytes (int8 for fp8's size too), unless it sets one."""
    if sync_bytes_per_param is None or step.sync_dtype != "float32":
        return step
    dtypes = {size: dtype for dtype, size in reversed(SYNC_DTYPE_BYTES.items())}
    if sync_bytes_per_param not in dtypes:
        raise ConfigError(f"sync_bytes_per_param: the trainer's sync dtypes have {sorted(dtypes)} bytes, "
                          f"got {sync_bytes_per_param!r}")
    return replace(step, sync_dtype=dtypes[sync_bytes_per_param])


def _dimension_links(cluster: Cluster, placement: Placement, method: str,
                     calibrated: bool) -> tuple[dict, dict, dict]:
    """Per mesh dimension: the slowest tier its groups span, the bits/s one flow gets, an all-reduce's steps."""
    cal = cluster.calibration if calibrated else None
    tiers: dict[str, str | None] = {}
    bw: dict[str, float | None] = {}
    steps: dict[str, int | None] = {}
    for dim in DIMENSIONS:
        # fl-hsdp: only replica r = 0 joins the cross-group all-reduce
        ranks = [placement.rank(0, 0, s) for s in range(placement.S)] if (dim, method) == ("federation", "fl-hsdp") \
            else None
        tiers[dim], bw[dim], steps[dim] = _ring_link(cluster, placement, placement.groups(dim, ranks), cal,
                                                     all_reduce=dim != "shard")
    return tiers, bw, steps


def _ring_link(cluster: Cluster, placement: Placement, rings: list[list[int]], cal: Calibration | None, *,
               all_reduce: bool = True) -> tuple[str | None, float | None, int | None]:
    """Rings (ranks) that run at once: the slowest tier they span, the bits/s one flow gets, an all-reduce's steps
    (NCCL's tree when calibrated so; None: the ring's)."""
    tier = placement.rings_tier(rings)
    if not tier:
        return None, None, None
    shared = set(cluster.shared) | (set(cal.uplink) if cal else set())
    bw = cluster.bandwidth[tier]
    flows = placement.ring_flows(rings) if shared else {}
    if cal is None:
        for t in cluster.shared:
            if flows[t]:
                bw = min(bw, cluster.bandwidth[t] / flows[t])
        return tier, bw, None
    uplinks = {t: (cal.uplink.get(t, cluster.bandwidth.get(t, 0.0)), flows[t]) for t in shared}
    bw = flow_bandwidth(bw, uplinks, cal.efficiency.get(tier, 1.0))
    steps = None
    if cal.tree_allreduce and cluster.backend == "nccl" and all_reduce:
        group = rings[0]
        steps = allreduce_steps(len(group), len({placement.node(x) for x in group}), tree=True)
    return tier, bw, steps


def plan(cluster: Cluster, model: ModelShape, *, aggregate_every: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
         methods: tuple[str, ...] = METHODS, fl_margin: float = 0.1, **options) -> list[Candidate]:
    """Every layout that fits in memory (`options`: `evaluate`'s), fastest first, an FL layout's step counted
    (1 + `fl_margin`) times longer (exact gradient averaging wins unless FL saves more)."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise ConfigError(f"--methods: choose among {', '.join(METHODS)}, got {', '.join(methods) or 'nothing'}")
    check_aggregate_every(aggregate_every)
    if fl_margin < 0:
        raise ConfigError(f"--fl-margin must be >= 0, got {fl_margin}")
    candidates = [evaluate(cluster, model, method, F=F, R=R, S=S, A=A, **options) for method, F, R, S, A in
                  layouts(cluster.gpus, cluster.gpus_per_node, tuple(methods), tuple(aggregate_every))]
    fitting = [c for c in candidates if c.fits]
    return sorted(fitting, key=lambda c: (c.step_time * (1 + fl_margin if c.federated else 1), c.A, c.F, c.R))


_TERM_NAMES = {"shard": "all-gathers/reduce-scatters over the sharding group",
               "replicate": "HSDP gradient all-reduces over the replication group",
               "sync": "the FL shard sync", "latency": "collective latency"}


def explain(best: Candidate, reference: Candidate | None, fastest: Candidate, fl_margin: float) -> str:
    """Why `best` is recommended: step time, dominant term, speedup over plain FSDP."""
    terms = {"shard": (best.comm.shard, best.tiers["shard"]), "replicate": (best.comm.replicate, best.tiers["replica"]),
             "sync": (best.comm.sync, best.tiers["federation"]), "latency": (best.comm.latency, None)}
    dominant = max(terms, key=lambda k: terms[k][0])
    where = f" ({terms[dominant][1]})" if terms[dominant][1] else ""
    bound = "compute" if best.compute >= best.comm.total else "communication"
    mostly = f", mostly {_TERM_NAMES[dominant]}{where}" if best.comm.total > 0 else ""
    if best.calibrated and best.phases is not None:
        p = best.phases
        text = (f"{best.label()}: {best.step_time:.3g} s/step = forward {p.forward:.3g} + backward {p.backward:.3g} + "
                f"optimizer {p.optimizer:.3g} + aggregation {p.aggregation:.3g} s ({best.compute:.3g} s compute, "
                f"{best.comm.total:.3g} s communication{mostly}; calibrated model); {bound}-bound")
    else:
        text = (f"{best.label()}: {best.step_time:.3g} s/step = {best.compute:.3g} s compute + "
                f"{best.comm.total:.3g} s communication{mostly}; {bound}-bound")
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
"""The paper's Table 4, measured: seconds per batch (mean, std) by phase, Llama-3.1-8B on 512 A100 GPUs of Leonardo,
2 x 2048 tokens per GPU, aggregation every 8 steps."""


@dataclass(frozen=True)
class PaperRow:
    """One of the paper's layouts: predicted step time next to the paper's measurement."""

    label: str
    predicted: Candidate
    paper_eq_comm: float
    """Communication seconds per step from Eqs. 1-5 literally (M = model bits / number of units)."""
    measured: dict[str, tuple[float, float]]
    """The paper's Table 4 row (mean, std) by phase."""


def paper_layouts(cluster: Cluster, model: ModelShape | None = None, *, A: int = 8, **options) -> list[PaperRow]:
    """Predictions for the paper's four layouts (on 512 GPUs) next to Table 4 (`options`: `evaluate`'s)."""
    if cluster.gpus != 512:
        raise ConfigError(f"--layouts paper: the paper's layouts use 512 GPUs, cluster {cluster.name} has "
                          f"{cluster.gpus}")
    model = model or model_from_preset("llama3.1-8b")
    rows = []
    for label, method, F, R, S in PAPER_LAYOUTS:
        layout = dict(F=F, R=R, S=S, A=A if F > 1 else 1)
        exact = evaluate(cluster, model, method, **layout, **{**options, "sizes": "exact"})
        literal = evaluate(cluster, model, method, **layout, **{**options, "sizes": "paper", "latency": False})
        rows.append(PaperRow(label=label, predicted=exact, paper_eq_comm=literal.comm.total,
                             measured=PAPER_TABLE4[label]))
    return rows
