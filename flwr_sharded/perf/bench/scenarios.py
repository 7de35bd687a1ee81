"""The benchmark inside the emulator: training runs on the fabric, the planner's view of the same cluster, repeats
merged, each scenario run and the whole benchmark written out."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES, sync_wire_ratio
from flwr_sharded.perf.bench.common import LABELS, _say
from flwr_sharded.perf.bench.layouts import (VARIANT_RUNS, Layout, SyncVariant, model_units, parse_layouts,
                                              sync_variant, vocab_size_of)
from flwr_sharded.perf.bench.plots import plot
from flwr_sharded.perf.bench.report import _json_default, agreement, checks, render
from flwr_sharded.perf.costmodel import Units
from flwr_sharded.perf.netemu.fabric import Fabric, RankFailure
from flwr_sharded.perf.netemu.isolation import enter_private_run
from flwr_sharded.perf.netemu.topology import _mem_available, load_topology, topology_dict
from flwr_sharded.perf.placement import Placement

# ---------------------------------------------------------------------------------------------------------------------
# One training run on the emulated cluster.


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


PHASE_NAMES = ("forward", "backward", "optimizer", "sync")


def summarize_metrics(path: Path) -> dict[str, Any]:
    """Windows, curves and final perplexities from a run's JSON-lines metrics (rank 0)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    config = next((r for r in records if r.get("kind") == "start"), {})
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise RuntimeError(f"{path}: no training windows logged")
    elapsed, prev_step, curve, times, windows = 0.0, 0, [], {}, []
    for r in train:
        n = r["step"] - prev_step
        elapsed += r["step_s"] * n
        prev_step = r["step"]
        times[r["step"]] = elapsed
        curve.append({"step": r["step"], "time_s": elapsed, "loss": r["loss"], "ppl": r["ppl"]})
        windows.append({"steps": n, "step_s": r["step_s"], **{k: r.get(f"{k}_s", 0.0) for k in PHASE_NAMES}})
    eval_curve = [{"step": e["step"], "time_s": times.get(e["step"], elapsed), "eval_ppl": e["eval_ppl"],
                   "eval_loss": e["eval_loss"]} for e in evals]
    return {"windows": windows, "syncs": train[-1].get("syncs", 0), "train": curve, "eval": eval_curve,
            "final": {"train_loss": train[-1]["loss"], "train_ppl": train[-1]["ppl"],
                      "eval_ppl": evals[-1]["eval_ppl"] if evals else None,
                      "eval_loss": evals[-1]["eval_loss"] if evals else None, "train_time_s": elapsed},
            "effective_batch": config.get("effective_batch"),
            "effective_batch_tokens": config.get("effective_batch_tokens"),
            "parameters": config.get("parameters")}


def step_stats(repeats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Step time over the windows of one or more repeats of a run, the first window of each left out (warm-up:
    lazy initialisation, first connections): median, mean (time / steps), standard deviation, phase medians."""
    steady = [w for windows in repeats for w in (windows[1:] or windows)]
    steps = sum(w["steps"] for w in steady)
    times = [w["step_s"] for w in steady]
    return {"step_s": _median(times), "step_s_mean": sum(w["step_s"] * w["steps"] for w in steady) / steps,
            "sync_s_mean": sum(w["sync"] * w["steps"] for w in steady) / steps,
            "step_s_std": statistics.pstdev(times) if len(times) > 1 else 0.0, "windows_used": len(steady),
            "phases": {k: _median([w[k] for w in steady]) for k in PHASE_NAMES},
            "phases_std": {k: statistics.pstdev([w[k] for w in steady]) if len(steady) > 1 else 0.0
                           for k in PHASE_NAMES}}


def run_training(fab: Fabric, layout: Layout, opts: argparse.Namespace, *, A: int, steps: int,
                 sync: bool = True, label: str | None = None, log_every: int | None = None,
                 units: Units | None = None, work: Path, variant: SyncVariant | None = None,
                 extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """Train one layout on the fabric; return its summary with measured and predicted traffic per tier (`units`:
    the model's, for a layout of equal groups). `variant`: how an FL layout syncs (default: the benchmark's
    `--sync-dtype`, blocking, one fragment); `extra_args`: more trainer flags. The run's metrics and traffic stay in
    its `run_dir` (under `work`)."""
    from flwr_sharded.perf.traffic_report import compare, load_probes

    topo = fab.topology
    label = label or layout.method
    run_dir = work / f"{label}-A{A}-{steps}"
    outputs, traffic_dir = run_dir / "run", run_dir / "traffic"
    metrics = outputs / "metrics.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(outputs, ignore_errors=True)
    log_every = log_every or A
    variant = variant or SyncVariant(dtype=opts.sync_dtype)
    argv = [sys.executable, "-m", "flwr_sharded.train", *layout.train_args(A, variant), "--model", opts.model,
            "--seq-len", str(opts.seq_len), "--batch-size", str(opts.batch_size), "--steps", str(steps),
            "--lr", str(opts.lr), "--seed", str(opts.seed), "--log-every", str(log_every),
            "--eval-every", str(opts.eval_every), "--eval-blocks", str(opts.eval_blocks),
            "--data-dir", opts.data_dir, "--no-progress", "--run-dir", str(outputs), "--no-save-model",
            "--measure-traffic", str(traffic_dir), "--timeout", str(opts.collective_timeout)]
    if not sync:
        argv.append("--no-sync")
    argv += list(extra_args)
    for attempt in (1, 2):
        start, load_before = time.perf_counter(), os.getloadavg()[0]
        try:
            fab.run_ranks(argv, world=layout.world, timeout=opts.run_timeout, log_dir=run_dir / "logs")
            break
        except RankFailure as exc:  # a native abort (a signal) is run again once, and said; anything else stops
            if attempt == 2 or exc.code is None or exc.code >= 0:
                raise
            _say(f"   {label}: {str(exc).splitlines()[0]}; running it again once")
            shutil.rmtree(outputs, ignore_errors=True)
            shutil.rmtree(traffic_dir, ignore_errors=True)
    wall = time.perf_counter() - start
    summary = summarize_metrics(metrics)
    out = {"label": label, "method": layout.method, "layout": layout.text(), "F": layout.F, "R": layout.R,
           "S": layout.S, "A": A if layout.method.startswith("fl-") else 1, "sync": sync, "steps": steps,
           "sync_variant": dataclasses.asdict(variant) if layout.method.startswith("fl-") else None,
           "wall_s": wall, "attempts": attempt, "run_dir": str(run_dir), "load_avg": [load_before, os.getloadavg()[0]], **summary,
           **step_stats([summary["windows"]]), "repeats": 1}
    if units is not None:
        placement = Placement(F=layout.F, R=layout.R, S=layout.S, gpus_per_node=topo.ranks_per_node,
                              nodes_per_group=topo.nodes_per_group)
        cmp = compare(load_probes(traffic_dir), layout.method, placement, units, A=out["A"], backend="gloo",
                      reshard_root=True, ranks_per_node=topo.ranks_per_node, uplinks=topo.uplinks(),
                      # the units are fp32 (4 bytes per parameter)
                      wire_ratio=sync_wire_ratio(variant.dtype, variant.topk, layout.F),
                      fragments=variant.fragments)
        out["traffic"] = cmp.to_dict()
        out["traffic_max_error"] = cmp.max_error()
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Planner agreement.


def planner_view(cluster_path: Path, layouts: dict[str, Layout], opts: argparse.Namespace, vocab: int,
                 A: int) -> dict[str, Any]:
    """The planner on the same cluster YAML: its first choice, and its prediction and ranking of the measured
    layouts (ranked as `plan` ranks: FL candidates count `fl_margin` slower)."""
    from flwr_sharded.perf.cluster import load_cluster
    from flwr_sharded.perf.memory_model import StepOptions
    from flwr_sharded.perf.planner import evaluate, plan

    cluster = load_cluster(cluster_path)
    shape = _shape(opts.model, vocab)
    kw = dict(tokens_per_gpu_batch=opts.batch_size * opts.seq_len, bytes_per_param=4.0,
              sync_bytes_per_param=float(SYNC_DTYPE_BYTES[opts.sync_dtype]))
    margin = opts.fl_margin
    rows = {}
    for method, lay in layouts.items():
        c = evaluate(cluster, shape, method, F=lay.F, R=lay.R, S=lay.S, A=A if method.startswith("fl-") else 1,
                     **kw)
        rows[method] = {"predicted_step_s": c.step_time, "comm_s": c.comm.total, "compute_s": c.compute,
                        "key": c.step_time * (1 + margin if c.federated else 1)}
    order = sorted(rows, key=lambda m: rows[m]["key"])
    variants = {}  # the FL+FSDP layout with the other syncs (not layouts: kept out of the ranking)
    for key in VARIANT_RUNS:
        if key in opts.method_list and "fl-fsdp" in layouts:
            v, lay = sync_variant(key, opts), layouts["fl-fsdp"]
            step = StepOptions(sync_fragments=v.fragments, sync_delay=v.delay, sync_carry=v.carry,
                               sync_error_feedback=v.error_feedback, sync_topk=v.topk)
            c = evaluate(cluster, shape, "fl-fsdp", F=lay.F, R=lay.R, S=lay.S, A=A,
                         **{**kw, "sync_bytes_per_param": SYNC_DTYPE_BYTES[v.dtype]}, step=step)
            variants[key] = {"predicted_step_s": c.step_time, "comm_s": c.comm.total, "compute_s": c.compute,
                             "hidden_sync_s": c.comm.hidden}
    # the same A as the measured FL runs: a larger A always predicts faster (and drifts more)
    candidates = plan(cluster, shape, aggregate_every=(A,), fl_margin=margin, memory_fraction=1.0, **kw)
    first = candidates[0] if candidates else None
    return {"cluster": cluster.name, "first_choice": None if first is None else
            {"method": first.method, "F": first.F, "R": first.R, "S": first.S, "A": first.A,
             "predicted_step_s": first.step_time},
            "measured_layouts": rows, "variants": variants, "predicted_order": order, "fl_margin": margin}


def _shape(model: str, vocab: int):
    from flwr_sharded.perf.model_shape import model_from_preset

    return model_from_preset(model, vocab)


# ---------------------------------------------------------------------------------------------------------------------
# The benchmark inside the emulator.


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one run: step statistics over all their windows; curves, traffic and quality of the first."""
    out = dict(runs[0])
    out.update(step_stats([r["windows"] for r in runs]))
    out["repeats"] = len(runs)
    out["repeat_step_s"] = [r["step_s"] for r in runs]
    out["wall_s"] = sum(r["wall_s"] for r in runs)
    out["load_avg"] = [x for r in runs for x in r["load_avg"]]
    out["traffic_max_error"] = max((r.get("traffic_max_error", 0.0) for r in runs), default=0.0)
    return out


def _scenario(name: str, cluster_path: Path, opts: argparse.Namespace, work: Path, vocab: int, *, main: bool,
              steps: int, repeats: int, batch_size: int | None = None) -> dict[str, Any]:
    opts = argparse.Namespace(**{**vars(opts), "batch_size": batch_size or opts.batch_size})
    topo = load_topology(cluster_path)
    layouts = parse_layouts(opts.layouts if main else None, topo)
    A = opts.aggregate_every
    result: dict[str, Any] = {"name": name, "cluster_file": str(cluster_path), "topology": topology_dict(topo),
                              "description": topo.describe(), "notes": list(topo.notes), "steps": steps,
                              "repeats": repeats, "batch_size": opts.batch_size, "seq_len": opts.seq_len,
                              "runs": {}, "sweep": []}
    units_by_S: dict[int, Units] = {}

    def units(S: int) -> Units:
        if S not in units_by_S:
            units_by_S[S] = model_units(opts.model, vocab, opts.seq_len, S)
        return units_by_S[S]

    plan = planner_view(cluster_path, layouts, opts, vocab, A)
    result["planner"] = plan
    # what to run: the methods, the no-sync limit, the planner's first choice if it is none of them
    jobs: dict[str, tuple[Layout, int, bool, SyncVariant | None]] = {}
    for key, lay in layouts.items():
        if key in opts.method_list:
            jobs[key] = (lay, A if key.startswith("fl-") else 1, True, None)
    if main and "no-sync" in opts.method_list and "fl-fsdp" in layouts:
        jobs["no-sync"] = (layouts["fl-fsdp"], A, False, None)
    for key in VARIANT_RUNS:  # today's FL+FSDP sync next to the overlapped and the 8-bit ones, in the same run
        if main and key in opts.method_list and "fl-fsdp" in layouts:
            jobs[key] = (layouts["fl-fsdp"], A, True, sync_variant(key, opts))
    first = plan["first_choice"]
    if opts.measure_planner_choice and first:
        lay = Layout(first["method"], first["F"], first["R"], first["S"])
        if not any(j == (lay, first["A"], True, None) for j in jobs.values()):
            jobs["planner-choice"] = (lay, first["A"], True, None)
    _say(f"\n== scenario {name}: {topo.describe()}; {steps} steps per run, {repeats} repeat(s)")
    for note in topo.notes:
        _say(f"   note: {note}")
    collected: dict[str, list[dict[str, Any]]] = {k: [] for k in jobs}
    with Fabric(topo) as fab:
        for rep in range(repeats):
            order = list(jobs) if rep % 2 == 0 else list(reversed(jobs))  # interleave: ABC, CBA, ...
            for key in order:
                lay, a, sync, variant = jobs[key]
                _say(f"-- {LABELS.get(key, key)} {lay.method} {lay.text()} A={a}"
                     f"{f' ({variant.text()})' if variant else ''} (repeat {rep + 1}) ...")
                # windows of the benchmark's A steps for every method: each holds one sync of the FL runs
                run = run_training(fab, lay, opts, A=a, steps=steps, sync=sync, label=f"{key}-r{rep}",
                                   log_every=max(a, opts.aggregate_every), units=units(lay.S), work=work / name,
                                   variant=variant)
                run["label"] = key
                collected[key].append(run)
                _say(f"   {run['step_s']:.3f} s/step (median of {run['windows_used']} windows), wall "
                     f"{run['wall_s']:.0f} s, bytes per tier within {run.get('traffic_max_error', float('nan')):.1%}"
                     f" of the prediction")
        result["runs"] = {k: _merge(v) for k, v in collected.items() if k != "planner-choice"}
        if "planner-choice" in collected:
            result["planner_choice_run"] = _merge(collected["planner-choice"])
        if main and "fl-fsdp" in layouts:
            lay = layouts["fl-fsdp"]
            for a in opts.sweep_values:
                if a == A and "fl-fsdp" in result["runs"]:
                    result["sweep"].append({**result["runs"]["fl-fsdp"], "reused": True})
                    continue
                # a warm-up window of 8 steps, then max(A, 8) x sweep_windows measured steps: whole sync periods
                sweep_steps = 8 + max(a, 8) * opts.sweep_windows
                _say(f"-- sweep: FL+FSDP {lay.text()} A={a}, {sweep_steps} steps ...")
                run = run_training(fab, lay, opts, A=a, steps=sweep_steps, label=f"sweep-A{a}", log_every=8,
                                   units=units(lay.S), work=work / name)
                result["sweep"].append(run)
                _say(f"   {run['step_s_mean']:.3f} s/step (mean after the first window)")
    result["agreement"] = agreement(result)
    return result


def _inner_main(opts: argparse.Namespace) -> int:
    """Runs inside `run_isolated`: builds each scenario's fabric, runs everything, reports."""
    enter_private_run()
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size_of(opts.data_dir)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flwr-bench-") as tmp:
        work = Path(opts.keep_runs) if opts.keep_runs else Path(tmp)
        results: dict[str, Any] = {
            "date": opts.date or _dt.date.today().isoformat(), "machine": _machine(),
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
            from flwr_sharded.perf.bench.unequal import unequal_scenario

            results["scenarios"]["unequal"] = unequal_scenario(Path(opts.unequal), opts, work, vocab)
        results["elapsed_s"] = time.perf_counter() - started
        results["checks"] = checks(results)
        report = render(results)
        print("\n" + report, flush=True)
        (out_dir / "bench.json").write_text(json.dumps(results, indent=1, default=_json_default))
        (out_dir / "bench.md").write_text(report + "\n")
        for name in plot(results, out_dir):
            _say(f"wrote {name}")
        _say(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'} ({results['elapsed_s'] / 60:.1f} min)")
    return 0


def _machine() -> dict[str, Any]:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "memory_gb": round(_mem_available() / 1e9, 1),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__}
