"""The benchmark inside the emulator: each scenario's runs and the planner's view of them, and the results."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES
from flwr_sharded_perf.provenance import provenance
from flwr_sharded_perf.bench.report import _json_default, render_report
from flwr_sharded_perf.bench.targets import agreement, checks, time_to_target_summary
from flwr_sharded_perf.bench.runs import (LABELS, UNEQUAL_LABELS, UNEQUAL_RUNS, VARIANT_RUNS, BenchLayout, SyncVariant,
                                          model_units, parse_layouts, run_training, step_stats, sync_variant,
                                          vocab_size_of)
from flwr_sharded_perf.costmodel import Units
from flwr_sharded_perf.netemu.network import EmuTopology, Fabric, _mem_available, load_topology, topology_dict
from flwr_sharded_perf.traffic_report import load_probes, ring_bytes_sent, sending_records


def planner_view(cluster_path: Path, layouts: dict[str, BenchLayout], opts: argparse.Namespace, vocab: int,
                 A: int) -> dict[str, Any]:
    """The planner on the same cluster: its first choice, its predictions and ranking of the measured layouts."""
    from flwr_sharded_perf.cluster import load_cluster
    from flwr_sharded_perf.memory_model import StepOptions
    from flwr_sharded_perf.model_shape import model_from_preset
    from flwr_sharded_perf.planner import evaluate, plan

    cluster, shape, margin = load_cluster(cluster_path), model_from_preset(opts.model, vocab), opts.fl_margin
    kw = dict(tokens_per_gpu_batch=opts.batch_size * opts.seq_len, bytes_per_param=4.0,
              sync_bytes_per_param=float(SYNC_DTYPE_BYTES[opts.sync_dtype]))

    def predict(method: str, lay: BenchLayout, **options: Any) -> dict[str, float]:
        fl = method.startswith("fl-")  # an FL run syncs by the cluster's sites (two levels where they make two)
        c = evaluate(cluster, shape, method, F=lay.F, R=lay.R, S=lay.S, A=A if fl else 1,
                     **{**kw, "sites": "groups" if fl and opts.sites == "cluster" else None, **options})
        return {"predicted_step_s": c.step_time, "comm_s": c.comm.total, "compute_s": c.compute,
                "key": c.step_time * (1 + margin if c.federated else 1), "hidden_sync_s": c.comm.hidden}

    rows = {method: predict(method, lay) for method, lay in layouts.items()}
    variants = {}  # the FL+FSDP layout with the other syncs (not layouts: kept out of the ranking)
    for key in (k for k in VARIANT_RUNS if k in opts.method_list and "fl-fsdp" in layouts):
        v = sync_variant(key, opts)
        variants[key] = predict("fl-fsdp", layouts["fl-fsdp"], sync_bytes_per_param=SYNC_DTYPE_BYTES[v.dtype],
                                sites=None if v.flat or v.topk else "groups",
                                step=StepOptions(sync_fragments=v.fragments, sync_delay=v.delay, sync_carry=v.carry,
                                                 sync_error_feedback=v.error_feedback, sync_topk=v.topk))
    # the same A as the measured FL runs: a larger A always predicts faster (and drifts more)
    candidates = plan(cluster, shape, aggregate_every=(A,), fl_margin=margin, memory_fraction=1.0, **kw)
    first = candidates[0] if candidates else None
    return {"cluster": cluster.name, "first_choice": None if first is None else
            {"method": first.method, "F": first.F, "R": first.R, "S": first.S, "A": first.A,
             "predicted_step_s": first.step_time},
            "measured_layouts": rows, "variants": variants, "fl_margin": margin,
            "predicted_order": sorted(rows, key=lambda m: rows[m]["key"])}


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one run: step statistics over all their windows; curves, traffic and quality of the first."""
    return {**runs[0], **step_stats([r["windows"] for r in runs]), "repeats": len(runs),
            "repeat_step_s": [r["step_s"] for r in runs], "wall_s": sum(r["wall_s"] for r in runs),
            "load_avg": [x for r in runs for x in r["load_avg"]],
            "traffic_max_error": max((r.get("traffic_max_error", 0.0) for r in runs), default=0.0)}


def _jobs(layouts: dict[str, BenchLayout], opts: argparse.Namespace, A: int, main: bool,
          first: dict[str, Any] | None) -> dict[str, tuple[BenchLayout, int, bool, SyncVariant | None]]:
    """What a scenario runs, (layout, A, sync, variant) by key: methods, no-sync, other syncs, the planner's choice."""
    jobs = {key: (lay, A if key.startswith("fl-") else 1, True, None) for key, lay in layouts.items()
            if key in opts.method_list}
    if main and "fl-fsdp" in layouts:
        if "no-sync" in opts.method_list:
            jobs["no-sync"] = (layouts["fl-fsdp"], A, False, None)
        for key in (k for k in VARIANT_RUNS if k in opts.method_list):
            jobs[key] = (layouts["fl-fsdp"], A, True, sync_variant(key, opts))
    if opts.measure_planner_choice and first:
        job = (BenchLayout(first["method"], first["F"], first["R"], first["S"]), first["A"], True, None)
        if job not in jobs.values():
            jobs["planner-choice"] = job
    return jobs


def _scenario(name: str, cluster_path: Path, opts: argparse.Namespace, work: Path, vocab: int, *, main: bool,
              steps: int, repeats: int, batch_size: int | None = None) -> dict[str, Any]:
    opts = argparse.Namespace(**{**vars(opts), "batch_size": batch_size or opts.batch_size})
    topo = load_topology(cluster_path)
    layouts = parse_layouts(opts.layouts if main else None, topo)
    A = opts.aggregate_every
    plan = planner_view(cluster_path, layouts, opts, vocab, A)
    result: dict[str, Any] = {"name": name, "cluster_file": str(cluster_path), "topology": topology_dict(topo),
                              "description": topo.describe(), "notes": list(topo.notes), "steps": steps,
                              "repeats": repeats, "batch_size": opts.batch_size, "seq_len": opts.seq_len,
                              "runs": {}, "sweep": [], "planner": plan}
    units_by_S: dict[int, Units] = {}

    def units(S: int) -> Units:
        if S not in units_by_S:
            units_by_S[S] = model_units(opts.model, vocab, opts.seq_len, S)
        return units_by_S[S]

    jobs = _jobs(layouts, opts, A, main, plan["first_choice"])
    print(f"\n== scenario {name}: {topo.describe()}; {steps} steps per run, {repeats} repeat(s)")
    for note in topo.notes:
        print(f"   note: {note}")
    collected: dict[str, list[dict[str, Any]]] = {k: [] for k in jobs}
    with Fabric(topo) as fab:
        for rep in range(repeats):
            for key in (list(jobs) if rep % 2 == 0 else list(reversed(jobs))):  # interleave: ABC, CBA, ...
                lay, a, sync, variant = jobs[key]
                print(f"-- {LABELS.get(key, key)} {lay.method} {lay.text()} A={a}"
                      f"{f' ({variant.text()})' if variant else ''} (repeat {rep + 1}) ...")
                # windows of the benchmark's A steps for every method: each holds one sync of the FL runs
                longer = main and opts.variant_steps and (key == "no-sync" or key in VARIANT_RUNS)
                run = run_training(fab, lay, opts, A=a, steps=opts.variant_steps if longer else steps, sync=sync,
                                   label=f"{key}-r{rep}",
                                   log_every=max(a, opts.aggregate_every), units=units(lay.S), work=work / name,
                                   variant=variant)
                collected[key].append({**run, "label": key})
                print(f"   {run['step_s']:.3f} s/step (median of {run['windows_used']} windows), wall "
                      f"{run['wall_s']:.0f} s, bytes per tier within "
                      f"{run.get('traffic_max_error', float('nan')):.1%} of the prediction")
        result["runs"] = {k: _merge(v) for k, v in collected.items() if k != "planner-choice"}
        if "planner-choice" in collected:
            result["planner_choice_run"] = _merge(collected["planner-choice"])
        for a in opts.sweep_values if main and "fl-fsdp" in layouts else ():
            if a == A and "fl-fsdp" in result["runs"]:
                result["sweep"].append({**result["runs"]["fl-fsdp"], "reused": True})
                continue
            # a warm-up window of 8 steps, then max(A, 8) x sweep_windows measured steps: whole sync periods
            sweep_steps = 8 + max(a, 8) * opts.sweep_windows
            print(f"-- sweep: FL+FSDP {layouts['fl-fsdp'].text()} A={a}, {sweep_steps} steps ...")
            run = run_training(fab, layouts["fl-fsdp"], opts, A=a, steps=sweep_steps, label=f"sweep-A{a}",
                               log_every=8, units=units(layouts["fl-fsdp"].S), work=work / name)
            result["sweep"].append(run)
            print(f"   {run['step_s_mean']:.3f} s/step (mean after the first window)")
    result["agreement"] = agreement(result)
    result["time_to_target"] = time_to_target_summary(result["runs"])
    return result


GROUP_STEPS_FLAG = "--group-steps"
"""The trainer's flag of the slow runs: each group's local steps (the slow group is `slow_train`'s)."""


def parse_group_shards(text: str) -> tuple[int, ...]:
    """`--unequal-groups` 2,4: at least two S >= 1, not all equal, whose sum F divides; else ConfigError."""
    try:
        shards = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--unequal-groups: expected each group's S, comma-separated (e.g. 2,4), got {text!r}") \
            from None
    if len(shards) < 2 or min(shards) < 1 or len(set(shards)) < 2:
        raise ConfigError(f"--unequal-groups: at least two groups with S >= 1 that are not all equal, got {text!r}")
    if sum(shards) % len(shards):
        raise ConfigError(f"--unequal-groups {text}: the equal federation next to it has {len(shards)} groups of "
                          f"their mean S, so their sum ({sum(shards)}) must be a multiple of {len(shards)}")
    return shards


def unequal_layouts(shards: tuple[int, ...], topo: EmuTopology, slow_group: int) -> dict[str, BenchLayout]:
    """The scenario's layouts (R = 1): the equal federation of F groups of the mean S, and the unequal one."""
    F = len(shards)
    if sum(shards) != topo.world_size:
        raise ConfigError(f"--unequal-groups {','.join(map(str, shards))}: {sum(shards)} ranks, the cluster of "
                          f"--unequal {topo.world_size}")
    if not 0 <= slow_group < F:
        raise ConfigError(f"--slow-group {slow_group}: the unequal federation has groups 0 to {F - 1}")
    return {"equal": BenchLayout("fl-fsdp", F, 1, sum(shards) // F),
            "unequal": BenchLayout.unequal("fl-fsdp", 1, shards)}


def cross_group_traffic(probes: list[dict[str, Any]], groups: Sequence[Sequence[int]],
                        backend: str = "gloo") -> dict[str, Any]:
    """Bytes the sync collectives spanning FL groups (ranks `groups`) sent, per sync and per sending group, and each
    rank's seconds per sync, from a `--measure-traffic` run's probes."""
    group_of = {r: g for g, ranks in enumerate(groups) for r in ranks}
    per_group, per_rank = [0.0] * len(groups), {p["rank"]: 0.0 for p in probes}
    for rank, rec, _ in sending_records(probes):
        if rec["phase"] == "sync" and len({group_of[r] for r in rec["ranks"]}) > 1:
            nbytes = ring_bytes_sent(rec["op"], rec["bytes"], len(rec["ranks"]), backend)
            per_group[group_of[rank]] += nbytes
            per_rank[rank] += nbytes
    syncs = probes[0]["windows"]["sync"] if probes else 0
    sync_s = [p["seconds"]["sync"] / p["windows"]["sync"] for p in probes if p["windows"]["sync"]]
    return {"syncs": syncs, "bytes": sum(per_group),
            "bytes_per_sync": sum(per_group) / syncs if syncs else None,
            "group_bytes_per_sync": [b / syncs for b in per_group] if syncs else None,
            "max_rank_bytes": max(per_rank.values()) / syncs if syncs and per_rank else None,
            "rank_sync_s": sync_s, "sync_s": max(sync_s, default=None), "sync_s_min": min(sync_s, default=None)}


def predicted_sync(shards_per_group: Sequence[int], R: int, shapes: Sequence[Sequence[int]], *,
                   bandwidth_bps: float | None, wire_ratio: float = 1.0) -> dict[str, Any]:
    """`unequal_sync` for the run's groups: cross-group bytes per sync and seconds at `bandwidth_bps` per channel."""
    from flwr_sharded_perf.unequal_sync_cost import unequal_sync

    sync = unequal_sync([(R, S) for S in shards_per_group], shapes, wire_ratio=wire_ratio, B_F=bandwidth_bps or 1.0,
                        B_R=[bandwidth_bps or 1.0] * len(shards_per_group))
    return {"bytes_per_sync": sum(sync.group_bytes), "group_bytes_per_sync": list(sync.group_bytes),
            "max_rank_bytes": sync.max_rank_bytes, "sync_s": sync.time if bandwidth_bps else None}


def sync_group_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `sync_groups` records (rank 0's, per sync and group) of a run's metrics, in step order."""
    return sorted((r for r in records if r.get("kind") == "sync_groups"), key=lambda r: r["step"])


def group_timing(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per group over a run's syncs (the first left out): mean step time, local steps, idle and sync seconds; the
    fastest group and its idle time per sync over its sync period. None without `sync_groups` records."""
    records = sync_group_records(records)
    if not records:
        return None
    steady = records[1:] or records
    F = len(steady[0]["step_time_s"])
    groups = [{key: statistics.fmean(float(r[key][g]) for r in steady)
               for key in ("step_time_s", "steps", "idle_s", "sync_s")} for g in range(F)]
    for g in groups:
        g["period_s"] = g["steps"] * g["step_time_s"] + g["sync_s"]
    fastest = min(range(F), key=lambda g: groups[g]["step_time_s"])
    fractions = [float(r["idle_s"][fastest]) / period for r in steady
                 if (period := float(r["steps"][fastest]) * float(r["step_time_s"][fastest])
                     + float(r["sync_s"][fastest])) > 0]
    return {"groups": groups, "fastest": fastest, "syncs_used": len(steady), "syncs": len(records),
            "fastest_idle_fraction": statistics.fmean(fractions) if fractions else None,
            "fastest_idle_fraction_max": max(fractions, default=None)}


def eval_tokens(records: list[dict[str, Any]], group_step_tokens: Sequence[float]) -> list[tuple[float, float]]:
    """(tokens the groups trained, eval ppl) of every eval of a run: the groups' steps up to it times their
    `group_step_tokens`, or without a sync at its step its `tokens_seen`."""
    trained, total = {}, 0.0
    for r in sync_group_records(records):
        total += sum(n * t for n, t in zip(r["steps"], group_step_tokens))
        trained[r["step"]] = total
    return sorted((float(tokens), float(r["eval_ppl"])) for r in records if r.get("kind") == "eval"
                  if (tokens := trained.get(r["step"], r.get("tokens_seen"))) is not None)


def ppl_at(curve: Sequence[tuple[float, float]], tokens: float) -> float | None:
    """Eval ppl at `tokens`, interpolated linearly in log ppl between the nearest eval points; None outside."""
    exact = [p for t, p in curve if t == tokens]
    if exact:
        return exact[0]
    for (t0, p0), (t1, p1) in zip(curve, curve[1:]):
        if t0 < tokens < t1:
            w = (tokens - t0) / (t1 - t0)
            return math.exp((1 - w) * math.log(p0) + w * math.log(p1))
    return None


def at_equal_tokens(run: list[tuple[float, float]], ref: list[tuple[float, float]]) -> dict[str, Any] | None:
    """Both runs' eval ppl at the fewer of their last eval points' tokens, and the run's relative difference."""
    if not run or not ref:
        return None
    tokens = min(run[-1][0], ref[-1][0])
    mine, theirs = ppl_at(run, tokens), ppl_at(ref, tokens)
    delta = mine / theirs - 1 if mine is not None and theirs is not None else None
    return {"tokens": tokens, "eval_ppl": mine, "ref_eval_ppl": theirs, "delta": delta}


def _inspect(run: dict[str, Any], layout: BenchLayout, shapes: list[tuple[int, ...]], bps: float | None,
             variant: SyncVariant) -> None:
    """Add the run's cross-group traffic, the cost model's, the groups' timings and its eval curve in tokens."""
    run_dir = Path(run["run_dir"])
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    run["cross_group"] = cross_group_traffic(load_probes(run_dir / "traffic"), layout.group_ranks())
    run["predicted_sync"] = predicted_sync(layout.shards_per_group, layout.R, shapes, bandwidth_bps=bps,
                                           wire_ratio=variant.wire_ratio(layout.F, run["steps"] // run["A"]))
    run["group_shards"] = list(layout.shards_per_group)
    run["sync_groups"] = sync_group_records(records)
    run["group_timing"] = group_timing(run["sync_groups"])
    run["eval_tokens"] = eval_tokens(records, [run["batch_size"] * run["seq_len"] * layout.R * S
                                               for S in layout.shards_per_group])


def slow_seconds(run: dict[str, Any], group: int) -> tuple[float, str]:
    """The sleep after each step that halves `group`'s speed in `run` (its step time there), and its source."""
    if timing := run.get("group_timing"):
        return timing["groups"][group]["step_time_s"], f"group {group}'s mean step time in the unequal run"
    return run["step_s"], "the unequal run's median step time"


def unequal_scenario(cluster_path: Path, opts: argparse.Namespace, work: Path, vocab: int) -> dict[str, Any]:
    """Train the scenario's runs one after the other on the cluster of `--unequal`; results as `_scenario`'s."""
    from flwr_sharded.training.models import build_model

    topo = load_topology(cluster_path)
    layouts = unequal_layouts(parse_group_shards(opts.unequal_groups), topo, opts.slow_group)
    A = opts.aggregate_every
    opts = argparse.Namespace(**{**vars(opts), "eval_every": min(opts.eval_every, A)})
    bps = topo.inter_group_bps if topo.groups > 1 else topo.inter_node_bps
    shapes = [tuple(p.shape) for p in build_model(opts.model, vocab_size=vocab, max_seq_len=opts.seq_len).parameters()]
    variant = SyncVariant(dtype=opts.sync_dtype)
    result: dict[str, Any] = {"name": "unequal", "cluster_file": str(cluster_path), "topology": topology_dict(topo),
                              "description": topo.describe(), "notes": list(topo.notes), "steps": opts.steps,
                              "repeats": 1, "batch_size": opts.batch_size, "seq_len": opts.seq_len, "A": A,
                              "sync_bps": bps, "runs": {}}
    print(f"\n== scenario unequal: {topo.describe()}; groups {layouts['equal'].text()} and "
          f"{layouts['unequal'].text()}; {opts.steps} steps per run")
    with Fabric(topo) as fab:
        def train(key: str, layout: BenchLayout, extra: list[str], eval_every: int | None = None,
                  slow: str | None = None) -> None:
            print(f"-- {UNEQUAL_LABELS[key]} {layout.text()} A={A} {' '.join(extra)}"
                  f"{f' (group:seconds slowed {slow})' if slow else ''} ...")
            run_opts = argparse.Namespace(**{**vars(opts), "eval_every": eval_every or opts.eval_every})
            # a training window never spans an evaluation (the trainer's windows restart after one)
            run = run_training(fab, layout, run_opts, A=A, steps=opts.steps, label=key,
                               log_every=min(A, eval_every or A), work=work / "unequal", variant=variant,
                               extra_args=extra, slow=slow)
            run.update(batch_size=opts.batch_size, seq_len=opts.seq_len)
            _inspect(run, layout, shapes, bps, variant)
            result["runs"][key] = run
            print(f"   {run['step_s']:.3f} s/step, wall {run['wall_s']:.0f} s, "
                  f"{(run['cross_group']['bytes_per_sync'] or 0) / 1e6:.3f} MB across groups per sync "
                  f"(model {run['predicted_sync']['bytes_per_sync'] / 1e6:.3f})")

        # the equal-speed reference of the --group-steps speed run evaluates every step: that run's tokens at its
        # evals fall between the reference's steps, which then lie one step apart (the evaluations, a collective of
        # the world, then line the groups up every step: that run's idle times are not today's)
        reference_eval = 1 if "unequal-slow-speed" in opts.unequal_run_list else None
        for key in ("equal", "unequal"):
            if key in opts.unequal_run_list:
                train(key, layouts[key], [], eval_every=reference_eval if key == "unequal" else None)
        slow_keys = [k for k in UNEQUAL_RUNS[2:] if k in opts.unequal_run_list]
        if slow_keys:
            seconds, why = opts.slow_seconds, "--slow-seconds"
            if seconds is None:
                if "unequal" not in result["runs"]:
                    raise ConfigError("--slow-seconds: unset, it is the unequal run's step time; run `unequal` "
                                      "too (--unequal-runs) or give the seconds")
                seconds, why = slow_seconds(result["runs"]["unequal"], opts.slow_group)
            result["slow"] = {"group": opts.slow_group, "seconds": seconds, "why": why}
            for key in slow_keys:
                train(key, layouts["unequal"], [GROUP_STEPS_FLAG, "speed" if key.endswith("speed") else "equal"],
                      slow=f"{opts.slow_group}:{seconds:.4f}")
    ref = result["runs"].get("unequal")
    for key in UNEQUAL_RUNS[2:]:
        if key in result["runs"] and ref:
            run = result["runs"][key]
            run["ppl_vs_equal_speed"] = at_equal_tokens(run["eval_tokens"], ref["eval_tokens"])
    return result


def _inner_main(opts: argparse.Namespace) -> int:
    """Runs inside `run_isolated`: builds each scenario's fabric, runs everything, reports."""
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size_of(opts.data_dir)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flwr-bench-") as tmp:
        work = Path(opts.keep_runs) if opts.keep_runs else Path(tmp)
        results: dict[str, Any] = {
            "date": opts.date or _dt.date.today().isoformat(), "machine": _machine(), "provenance": provenance(),
            "settings": {k: v for k, v in vars(opts).items() if k not in ("func",)},
            "vocab_size": vocab, "scenarios": {}}
        if opts.method_list:
            results["scenarios"]["main"] = _scenario("main", Path(opts.cluster), opts, work, vocab, main=True,
                                                     steps=opts.steps, repeats=opts.repeats)
        if opts.contrast:
            results["scenarios"]["contrast"] = _scenario("contrast", Path(opts.contrast), opts, work, vocab,
                                                         main=False, steps=opts.contrast_steps or opts.steps,
                                                         repeats=opts.contrast_repeats,
                                                         batch_size=opts.contrast_batch_size)
        if opts.unequal:
            results["scenarios"]["unequal"] = unequal_scenario(Path(opts.unequal), opts, work, vocab)
        results["elapsed_s"] = time.perf_counter() - started
        results["checks"] = checks(results)
        report = render_report(results)
        print("\n" + report, flush=True)
        (out_dir / "bench.json").write_text(json.dumps(results, indent=1, default=_json_default))
        (out_dir / "bench.md").write_text(report + "\n")
        for name in plot_results(results, out_dir):
            print(f"wrote {name}")
        print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'} ({results['elapsed_s'] / 60:.1f} min)")
    return 0


def plot_results(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """time_to_ppl.png (training perplexity against training time, like the paper's Figure 2) and a_sweep.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'flwr_sharded[plot]')")
        return []
    main = results["scenarios"].get("main")
    if main is None:
        return []
    written: list[Path] = []

    def save(fig: Any, ax: Any, name: str) -> None:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, r in main["runs"].items():
        line, = ax.plot([p["time_s"] for p in r["train"]], [p["ppl"] for p in r["train"]],
                        "--" if key == "no-sync" else "-", label=LABELS[key], marker=".")
        if r["eval"]:
            ax.plot([e["time_s"] for e in r["eval"]], [e["eval_ppl"] for e in r["eval"]], "x", color=line.get_color(),
                    markersize=8)
    ax.set(yscale="log", xlabel="training time (s)", ylabel="training perplexity (x: evaluation)",
           title=f"{main['topology']['name']}: {results['settings']['model']}, same samples, "
                 f"A={results['settings']['aggregate_every']}")
    save(fig, ax, "time_to_ppl.png")
    if main.get("sweep"):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        As = [r["A"] for r in main["sweep"]]
        ax.plot(As, [r["step_s_mean"] for r in main["sweep"]], "o-", label="FL+FSDP s/step")
        ax.plot(As, [max(r["sync_s_mean"], 1e-4) for r in main["sweep"]], "s--", label="of which sync (s/step)")
        if "no-sync" in main["runs"]:
            ax.axhline(main["runs"]["no-sync"]["step_s_mean"], linestyle="--", color="gray", label="no-sync limit")
        if "fsdp" in main["runs"]:
            ax.axhline(main["runs"]["fsdp"]["step_s_mean"], linestyle=":", color="red", label="FSDP")
        ax.set_xscale("log", base=2)
        ax.set_xticks(As, [str(a) for a in As])
        ax.set(yscale="log", xlabel="A (steps between syncs)", ylabel="seconds per step")
        save(fig, ax, "a_sweep.png")
    return written


def _machine() -> dict[str, Any]:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "memory_gb": round(_mem_available() / 1e9, 1),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__}
