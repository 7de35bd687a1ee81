"""`flwr-sharded plan`: the planner's command line (its options, the ranked table, JSON, the paper's layouts)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from flwr_sharded import schema, tool_options
from flwr_sharded.config import METHODS, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.rules import RULES
from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES, SyncDtype
from flwr_sharded.presets import PRESETS
from flwr_sharded_perf.cluster import Cluster, FacilityFederation, load_description
from flwr_sharded_perf.memory_model import GiB, StepOptions
from flwr_sharded_perf.model_shape import ModelShape, model_from_name
from flwr_sharded_perf.federation_planner import FederationCandidate, plan_federation
from flwr_sharded_perf.planner import Candidate, PaperRow, evaluate, explain, paper_layouts, plan
from flwr_sharded.schema import option, same_as
from flwr_sharded_perf.wire_choice import advice

PHASE_COLUMNS = ("forward", "backward", "optimizer", "aggregation", "overall")
PROTOCOL_LATENCIES = (0.01, 0.05, 0.1)
"""Seconds per step across sites at which `plan` shows the sync protocol's share, besides the cluster's own."""


@dataclass
class PlanOptions:
    """`flwr-sharded plan`: rank every (method, F, R, S, A) layout of a cluster with the cost model."""

    cluster: str | None = option(None, required=True)
    """Cluster YAML (see examples/clusters/); one that lists `facilities` plans a federation of facilities of different
    sizes: each facility's R and S, its local steps per sync and its idle time."""
    model: str | None = option(None, facts={"presets": ", ".join(PRESETS)})
    """A model as `train --model` takes it: a preset ({presets}), a Hugging Face model directory or hub id (its
    architecture read from config.json: dense or mixture-of-experts, priced by its total and active parameters); or
    a model without either: `params` and `layers`."""
    params: float | None = option(None, gt=0)
    """Parameter count of a model without preset, e.g. 8e9 (with `layers`)."""
    layers: int | None = option(None, ge=1)
    """Transformer blocks of that model (with `params`)."""
    hidden_size: int | None = option(None, ge=1)
    """Width of that model, for the activation estimate (with `params`)."""
    vocab_size: int = option(32000, ge=1)
    """Vocabulary of a preset without one, and of a model without preset."""
    bytes_per_param: float = option(2.0, gt=0)
    """Bytes per parameter on the wire and in compute (2: bf16, 4: fp32)."""
    sync_dtype: SyncDtype | None = same_as(ParallelConfig, "sync_dtype", default=None)
    """Wire dtype of the FL shard sync's all-reduce (`flwr-sharded train --sync-dtype`): its bytes are parameters x
    the dtype's size; unset: `bytes-per-param`, like the other collectives."""
    sync_topk: float | None = same_as(ParallelConfig, "sync_topk")
    """The FL shard sync's top-k fraction (`flwr-sharded train --sync-topk`): its rows, all-gathered, instead of the
    all-reduce (their bytes grow with F); unset: dense."""
    steps: int | None = option(None, ge=1)
    """The run's optimizer steps: with `sync-topk`, the recommended layout's syncs (steps / A) are checked against
    the syncs top-k needs for the dense sync's quality, and the dense 2-bit wire is recommended below them
    (`flwr_sharded_perf.wire_choice`)."""
    state_bytes_per_param: float | None = option(None, gt=0)
    """Bytes per parameter of parameters + gradients + optimizer state together; unset: the trainer's (fp32 weights,
    gradients and AdamW moments: 16)."""
    optimizer: Literal["adamw", "sgd"] = same_as(OptimConfig, "optimizer")
    outer: str = same_as(ParallelConfig, "outer")
    bucket_mb: float = same_as(ParallelConfig, "bucket_mb")
    grad_accum: int = same_as(TrainConfig, "grad_accum")
    reshard_after_forward: bool = same_as(ModelConfig, "reshard_after_forward")
    activation_checkpointing: bool = same_as(ModelConfig, "activation_checkpointing")
    tokens_per_gpu: int = option(2 * 2048, ge=1)
    """Tokens per GPU per optimizer step (the paper's 2 x 2048), split over `grad-accum` micro-batches."""
    aggregate_every: str = "1,2,4,8,16,32"
    """Values of A to try for FL methods, comma-separated (for a federation of facilities: the fastest one's)."""
    methods: str = ",".join(METHODS)
    """Methods to consider, comma-separated."""
    top: int = option(10, ge=1)
    """Rows to print."""
    sizes: Literal["exact", "paper"] = "exact"
    """Message sizes: each collective's own (exact) or one M for all, as the paper's Eqs. 1-5 (paper)."""
    latency: bool = False
    """Add the cluster's per-tier latency per ring step (a cluster with a `calibration` always counts it)."""
    memory_fraction: float = option(0.9, gt=0, le=1)
    """Usable share of a GPU's memory."""
    fl_margin: float = option(0.1, ge=0)
    """FL must be this fraction faster than a synchronous method to rank above it."""
    sites: Literal["groups"] | None = None
    """`groups`: price the FL sync as the two-level (site-aware) scheme with the cluster's node groups as sites (a
    layout whose members span groups, or fill them unequally, keeps the flat ring); unset: the flat ring."""
    protocol: bool = False
    """Count the sync's exchanges besides its reduction (admission, result vote, a blocking sync's commit vote:
    `costmodel.PROTOCOL`) in the prediction, at the federation tier's latency (where latency counts)."""
    layouts: Literal["paper"] | None = None
    """`paper`: instead of planning, predict the paper's four 512-GPU layouts next to its Table 4."""
    json: bool = False
    """Print JSON instead of a table."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `plan` sub-command (options: `PlanOptions`); its handler returns an exit code."""
    p = subparsers.add_parser(
        "plan", help="rank (method, F, R, S, A) layouts for a cluster with the communication cost model",
        description="Predict compute + communication per optimizer step for every layout using all GPUs of a "
                    "cluster, rank them and recommend one (see docs/cost-model.md).",
        formatter_class=schema.HelpFormatter)
    schema.add_arguments(p, PlanOptions)
    p.set_defaults(func=run_plan)
    return p


def resolve_plan(parsed: argparse.Namespace) -> argparse.Namespace:
    """The plan's options from a parsed command line, with `evaluate`'s (`evaluation`); ConfigError naming the flag."""
    opts = schema.apply_arguments(PlanOptions(), parsed)
    if opts.outer not in RULES:
        raise ConfigError(f"--outer: choose one of {', '.join(RULES)}, got {opts.outer!r}")
    values = {o.path[-1]: schema.get(opts, o.path) for o in schema.options(opts)}
    names = {f.name for f in fields(StepOptions)} & set(values)  # the memory model's step: the trainer's options
    step = StepOptions(**{**{n: values[n] for n in names}, "sync_dtype": opts.sync_dtype or "float32"})
    values.update(aggregate_every=tuple(tool_options.split_list(opts.aggregate_every, "--aggregate-every", int)),
                  methods=tool_options.split_list(opts.methods, "--methods", allowed=METHODS),
                  params=None if opts.params is None else int(opts.params), step=step)
    values["evaluation"] = dict(
        tokens_per_gpu_batch=opts.tokens_per_gpu, bytes_per_param=opts.bytes_per_param, sizes=opts.sizes,
        state_bytes_per_param=opts.state_bytes_per_param, latency=opts.latency, memory_fraction=opts.memory_fraction,
        activation_checkpointing=opts.activation_checkpointing, step=step,
        sync_bytes_per_param=SYNC_DTYPE_BYTES.get(opts.sync_dtype), sites=opts.sites, protocol=opts.protocol)
    return argparse.Namespace(**values)


def _model_from_args(args: argparse.Namespace) -> ModelShape | None:
    if args.model and args.params:
        raise ConfigError("--model and --params are exclusive: give a model or a parameter count with --layers")
    if args.model:
        return model_from_name(args.model, args.vocab_size)
    if args.params and not args.layers:
        raise ConfigError("--params needs --layers (number of transformer blocks)")
    if args.params:
        return ModelShape.from_counts(args.params, args.layers, hidden_size=args.hidden_size,
                                      vocab_size=args.vocab_size)
    return None


def _params(model: ModelShape) -> str:
    """The model's parameters for a header line (and the active ones of a mixture of experts)."""
    active = f", {model.compute_params / 1e9:.3g} B active" if model.compute_params != model.num_params else ""
    return f"{model.num_params / 1e9:.3g} B params{active}"


def _candidate_dict(c: Candidate) -> dict[str, Any]:
    return {"method": c.method, "F": c.F, "R": c.R, "S": c.S, "A": c.A, "tiers": c.tiers, "bandwidth": c.bandwidth,
            "comm_s": c.comm.total, "comm_terms_s": asdict(c.comm), "compute_s": c.compute, "step_s": c.step_time,
            "calibrated": c.calibrated, "phases_s": c.phases.as_dict() if c.phases else None,
            "batch_tokens": c.batch_tokens, "memory_gib": c.memory.total / GiB, "fits": c.fits,
            "memory_peak_phase": c.memory.peak_phase,
            "memory_terms_gib": {k: v / GiB for k, v in c.memory.terms().items()},
            "memory_phases_gib": {k: v / GiB for k, v in c.memory.phases.items()}}


def _print_paper(cluster: Cluster, rows: list[PaperRow], args: argparse.Namespace) -> None:
    """The paper's layouts, predicted next to Table 4; per phase with the ratio; the speedups over FSDP."""
    if args.json:
        print(json.dumps([{"layout": r.label, **_candidate_dict(r.predicted), "paper_eq_comm_s": r.paper_eq_comm,
                           "table4_measured": r.measured} for r in rows], indent=2))
        return
    ckpt = ", activation checkpointing" if args.activation_checkpointing else ""
    print(f"Paper layouts on {cluster.name} ({args.model or 'llama3.1-8b'}, {args.tokens_per_gpu} tokens/GPU, "
          f"A=8{ckpt}): predicted s/step vs measured (the paper's Table 4: Llama-3.1-8B, 4096 tokens/GPU, s/batch), "
          f"and the trainer's peak memory per GPU")
    print(f"{'layout':<8} {'F':>4} {'R':>4} {'S':>4} {'comm Eq.1-5':>11} {'comm exact':>10} {'compute':>8} "
          f"{'predicted':>9} {'Table 4':>12} {'fwd+bwd':>7} {'aggr.':>5} {'mem/GPU GiB':>11} {'fits':>4}")
    for r in rows:
        c, m = r.predicted, r.measured
        overall = f"{m['overall'][0]:.2f}±{m['overall'][1]:.2f}"
        print(f"{r.label:<8} {c.F:>4} {c.R:>4} {c.S:>4} {r.paper_eq_comm:>11.3f} {c.comm.total:>10.3f} "
              f"{c.compute:>8.3f} {c.step_time:>9.3f} {overall:>12} {m['forward'][0] + m['backward'][0]:>7.2f} "
              f"{m['aggregation'][0]:>5.2f} {c.memory.total / GiB:>11.1f} {'yes' if c.fits else 'NO':>4}")
    model = "calibrated" if rows[0].predicted.calibrated else "paper's (no overlap, no optimizer step)"
    print(f"Per phase, s/step predicted ({model} model) / Table 4 measured (predicted/measured):")
    print(f"{'layout':<8} " + " ".join(f"{p:>20}" for p in PHASE_COLUMNS))
    for r in rows:
        phases = r.predicted.phases.as_dict()
        cells = [f"{phases[p]:.2f}/{m:.2f} ({f'{phases[p] / m:.2f}' if m > 0 else '-'})"
                 for p, m in ((p, r.measured[p][0]) for p in PHASE_COLUMNS)]
        print(f"{r.label:<8} " + " ".join(f"{c:>20}" for c in cells))
    base, parts = rows[0], []
    for r in rows[1:]:
        predicted = base.predicted.step_time / r.predicted.step_time
        measured = base.measured["overall"][0] / r.measured["overall"][0]
        parts.append(f"{r.label} {predicted:.2f}x / {measured:.2f}x ({predicted / measured:.2f})")
    print("Speedup over FSDP, predicted / measured (ratio): " + ", ".join(parts))
    if not all(r.predicted.fits for r in rows):
        usable = args.memory_fraction * cluster.gpu_memory / GiB
        print(f"NO: more than {args.memory_fraction:.0%} of the GPU's memory ({usable:.1f} GiB) at the step's peak "
              f"({', '.join(sorted({r.predicted.memory.peak_phase for r in rows if not r.predicted.fits}))}); "
              f"try --activation-checkpointing or fewer --tokens-per-gpu")


def run_plan(parsed: argparse.Namespace) -> int:
    """Handler of `flwr-sharded plan`; a bad option value is a usage error (exit 2), as argparse's own."""
    try:
        args = resolve_plan(parsed)
    except ConfigError as exc:
        print(f"flwr-sharded plan: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    options = args.evaluation
    try:
        cluster = load_description(args.cluster)
        model = _model_from_args(args)
        if isinstance(cluster, FacilityFederation):
            return _run_federation(cluster, model, args)
        if args.layouts == "paper":
            _print_paper(cluster, paper_layouts(cluster, model, **options), args)
            return 0
        if model is None:
            raise ConfigError("give a model: --model PRESET|MODEL_DIR|ORG/NAME, or --params N --layers L")
        candidates = plan(cluster, model, aggregate_every=tuple(args.aggregate_every),
                          methods=tuple(args.methods), fl_margin=args.fl_margin, **options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reference = evaluate(cluster, model, "fsdp", S=cluster.gpus, **options)
    if not candidates:
        print(f"error: no layout fits in {args.memory_fraction:.0%} of {cluster.gpu_memory / GiB:.1f} GiB per GPU "
              f"(fsdp over all {cluster.gpus} GPUs needs {reference.memory.total / GiB:.1f} GiB); try "
              f"--activation-checkpointing, fewer --tokens-per-gpu or a bigger cluster", file=sys.stderr)
        return 1
    best = candidates[0]
    reason = explain(best, reference, min(candidates, key=lambda c: c.step_time), args.fl_margin)
    wire = (advice(args.sync_topk, args.steps // best.A, best.F)
            if args.sync_topk and args.steps and best.federated else None)
    fl = next((c for c in candidates if c.fragment_sync is not None), None)
    protocol = _protocol_rows(fl, cluster) if fl is not None else []
    if args.json:
        print(json.dumps({"cluster": cluster.name, "model": model.name,
                          "candidates": [_candidate_dict(c) for c in candidates[:args.top]],
                          "recommended": _candidate_dict(best), "reason": reason, "wire_advice": wire,
                          "protocol_share": {"layout": fl.label(), "rows": protocol} if fl else None}, indent=2))
        return 0
    groups = f", node groups of {cluster.nodes_per_group} nodes" if cluster.nodes_per_group else ""
    print(f"Cluster {cluster.name}: {cluster.nodes} x {cluster.gpus_per_node} GPUs = {cluster.gpus}{groups}; "
          f"model {model.name} ({_params(model)}, {args.bytes_per_param:g} bytes each); "
          f"{args.tokens_per_gpu} tokens per GPU per step"
          + (f"; FL sync in {args.sync_dtype}" if args.sync_dtype else "")
          + (f", top-{args.sync_topk * 100:g}% of each chunk" if args.sync_topk else ""))
    print(f"{'#':>3} {'method':<8} {'F':>4} {'R':>4} {'S':>4} {'A':>3} {'comm s/step':>11} {'total s/step':>12} "
          f"{'eff. batch tok':>14} {'mem/GPU GiB':>11}  tiers S/R/F")
    for i, c in enumerate(candidates[:args.top], 1):
        tiers = "/".join(c.tiers[d] or "-" for d in ("shard", "replica", "federation"))
        print(f"{i:>3} {c.method:<8} {c.F:>4} {c.R:>4} {c.S:>4} {c.A:>3} {c.comm.total:>11.4g} {c.step_time:>12.4g} "
              f"{c.batch_tokens:>14,} {c.memory.total / GiB:>11.1f}  {tiers}")
    if fl is not None:
        _print_protocol(fl, protocol)
    print(f"Recommended: {reason}")
    if wire:
        print(f"Wire: {wire}")
    return 0


def _protocol_rows(c: Candidate, cluster: Cluster) -> list[dict[str, Any]]:
    """One fragment sync of `c` at the cluster's latency across its federation and at `PROTOCOL_LATENCIES`: its
    bytes' seconds, its reduction's steps and each kind's other exchanges (`costmodel.PROTOCOL`), with their share."""
    fs, tier = c.fragment_sync, c.tiers["federation"]
    rows = []
    for alpha, where in ((cluster.latency.get(tier, 0.0), tier),
                         *((a, "") for a in PROTOCOL_LATENCIES)):
        kinds = {k: replace(fs, kind=k) for k in ("blocking", "overlapped")}
        rows.append({"latency_s": alpha, "where": where, "data_s": fs.data, "reduction_s": fs.reduction(alpha),
                     "exchanges_s": {k: f.protocol(alpha) for k, f in kinds.items()},
                     "share": {k: f.protocol_share(alpha) for k, f in kinds.items()}})
    return rows


def _print_protocol(c: Candidate, rows: list[dict[str, Any]]) -> None:
    fs = c.fragment_sync
    scheme = f"two-level over {fs.sites.G} sites of {fs.sites.L}" if fs.sites else "flat ring"
    print(f"Sync protocol of {c.label()}: one fragment sync ({fs.members} members, {scheme}, {fs.collectives:.3g} "
          f"reductions), seconds at the cluster's latency per step across sites and at others; the exchanges' share:")
    print(f"{'latency per step':>25} {'bytes s':>9} {'reduction s':>11} {'blocking exchanges':>22} "
          f"{'overlapped exchanges':>22}")
    for r in rows:
        latency = f"at {r['latency_s'] * 1e3:g} ms" + (f" ({r['where']})" if r["where"] else "")
        cells = [f"{r['exchanges_s'][k]:.4g} ({r['share'][k]:.0%})" for k in ("blocking", "overlapped")]
        print(f"{latency:>25} {r['data_s']:>9.4g} {r['reduction_s']:>11.4g} {cells[0]:>22} {cells[1]:>22}")


def _run_federation(federation: FacilityFederation, model: ModelShape | None, args: argparse.Namespace) -> int:
    """`plan` on a federation of facilities: each facility's (R, S), its A_g and idle time, the ranked table."""
    if args.layouts == "paper":
        raise ConfigError(f"--layouts paper: {federation.name} is a federation of facilities, the paper's layouts "
                          f"need one 512-GPU cluster")
    if model is None:
        raise ConfigError("give a model: --model PRESET|MODEL_DIR|ORG/NAME, or --params N --layers L")
    ranked = plan_federation(federation, model, aggregate_every=tuple(args.aggregate_every), **args.evaluation)
    best = ranked[0]
    if args.json:
        print(json.dumps({"federation": federation.name, "model": model.name,
                          "candidates": [_federation_dict(c) for c in ranked[:args.top]],
                          "recommended": _federation_dict(best)}, indent=2))
        return 0
    sites = ", ".join(f"{f.name} {f.nodes} x {f.gpus_per_node} GPUs ({f.flops_per_gpu / 1e12:g} TFLOP/s each)"
                      for f in federation.facilities)
    print(f"Federation {federation.name}: {sites}; {federation.inter_group / 1e9:g} Gbit/s between facilities"
          f"{' (one shared uplink each)' if federation.shared else ''}; model {model.name} "
          f"({_params(model)}, {args.bytes_per_param:g} bytes each); {args.tokens_per_gpu} "
          f"tokens per GPU per step" + (f"; FL sync in {args.sync_dtype}" if args.sync_dtype else ""))
    print(f"{'#':>3} {'R x S per facility':<24} {'A per facility':<16} {'sync s':>8} {'period s':>9} "
          f"{'tokens/s':>10} {'max MB/rank':>11}")
    for i, c in enumerate(ranked[:args.top], 1):
        shapes, steps = ", ".join(f"{f.R}x{f.S}" for f in c.facilities), ", ".join(str(f.A) for f in c.facilities)
        print(f"{i:>3} {shapes:<24} {steps:<16} {c.sync.time:>8.4g} {c.period:>9.4g} {c.tokens_per_second:>10,.0f} "
              f"{c.sync.max_rank_bytes / 1e6:>11.4g}")
    print(f"Recommended: {best.label()}: {best.tokens_per_second:,.0f} tokens/s; a sync every "
          f"{best.period:.4g} s = {best.compute_period:.4g} s of local steps + {best.sync.time:.4g} s of sync "
          f"(busiest rank {best.sync.busiest:.4g} s); larger A saves communication but lets groups drift")
    print(f"{'facility':<12} {'GPUs':>5} {'R':>3} {'S':>3} {'step s':>8} {'A_g':>4} {'idle s/sync':>11} "
          f"{'idle, equal A':>13} {'MB/rank/sync':>12} {'mem/GPU GiB':>11}")
    for g, f in enumerate(best.facilities):
        print(f"{f.name:<12} {f.gpus:>5} {f.R:>3} {f.S:>3} {f.local.step_time:>8.4g} {f.A:>4} {f.idle:>11.4g} "
              f"{f.idle_equal:>13.4g} {max(best.sync.rank_bytes[g]) / 1e6:>12.4g} {f.memory.total / GiB:>11.1f}")
    return 0


def _federation_dict(c: FederationCandidate) -> dict[str, Any]:
    return {"A": c.A, "sync_s": c.sync.time, "sync_busiest_rank_s": c.sync.busiest, "period_s": c.period,
            "compute_period_s": c.compute_period, "tokens_per_s": c.tokens_per_second,
            "max_rank_bytes": c.sync.max_rank_bytes,
            "facilities": [{"name": f.name, "gpus": f.gpus, "R": f.R, "S": f.S, "method": f.local.method,
                            "step_s": f.local.step_time, "A": f.A, "idle_s": f.idle, "idle_equal_A_s": f.idle_equal,
                            "rank_bytes": list(c.sync.rank_bytes[g]), "group_bytes": c.sync.group_bytes[g],
                            "broadcast_bytes": c.sync.broadcast_bytes[g], "memory_gib": f.memory.total / GiB}
                           for g, f in enumerate(c.facilities)]}
