"""The benchmark inside the emulator: each scenario's training runs on its fabric next to the planner's view of the
same cluster, repeats merged, and the whole benchmark written out (bench.json, bench.md and the plots)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES
from flwr_sharded.perf.bench.report import _json_default, agreement, checks, render
from flwr_sharded.perf.bench.runs import (LABELS, VARIANT_RUNS, BenchLayout, SyncVariant, model_units, parse_layouts,
                                          run_training, step_stats, sync_variant, vocab_size_of)
from flwr_sharded.perf.bench.unequal_scenario import unequal_scenario
from flwr_sharded.perf.costmodel import Units
from flwr_sharded.perf.netemu.network import Fabric, _mem_available, load_topology, topology_dict


def planner_view(cluster_path: Path, layouts: dict[str, BenchLayout], opts: argparse.Namespace, vocab: int,
                 A: int) -> dict[str, Any]:
    """The planner on the same cluster YAML: its first choice, its prediction and ranking of the measured layouts
    (FL counted `fl_margin` slower, as `plan` ranks) and of the FL+FSDP layout's other syncs."""
    from flwr_sharded.perf.cluster import load_cluster
    from flwr_sharded.perf.memory_model import StepOptions
    from flwr_sharded.perf.model_shape import model_from_preset
    from flwr_sharded.perf.planner import evaluate, plan

    cluster, shape, margin = load_cluster(cluster_path), model_from_preset(opts.model, vocab), opts.fl_margin
    kw = dict(tokens_per_gpu_batch=opts.batch_size * opts.seq_len, bytes_per_param=4.0,
              sync_bytes_per_param=float(SYNC_DTYPE_BYTES[opts.sync_dtype]))

    def predict(method: str, lay: BenchLayout, **options: Any) -> dict[str, float]:
        c = evaluate(cluster, shape, method, F=lay.F, R=lay.R, S=lay.S, A=A if method.startswith("fl-") else 1,
                     **{**kw, **options})
        return {"predicted_step_s": c.step_time, "comm_s": c.comm.total, "compute_s": c.compute,
                "key": c.step_time * (1 + margin if c.federated else 1), "hidden_sync_s": c.comm.hidden}

    rows = {method: predict(method, lay) for method, lay in layouts.items()}
    variants = {}  # the FL+FSDP layout with the other syncs (not layouts: kept out of the ranking)
    for key in (k for k in VARIANT_RUNS if k in opts.method_list and "fl-fsdp" in layouts):
        v = sync_variant(key, opts)
        variants[key] = predict("fl-fsdp", layouts["fl-fsdp"], sync_bytes_per_param=SYNC_DTYPE_BYTES[v.dtype],
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
    """What a scenario runs, (layout, A, sync, variant) by key: the methods; on the main cluster the no-sync limit and
    the FL+FSDP layout's other syncs; the planner's first choice if it is none of them."""
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
                run = run_training(fab, lay, opts, A=a, steps=steps, sync=sync, label=f"{key}-r{rep}",
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
            results["scenarios"]["unequal"] = unequal_scenario(Path(opts.unequal), opts, work, vocab)
        results["elapsed_s"] = time.perf_counter() - started
        results["checks"] = checks(results)
        report = render(results)
        print("\n" + report, flush=True)
        (out_dir / "bench.json").write_text(json.dumps(results, indent=1, default=_json_default))
        (out_dir / "bench.md").write_text(report + "\n")
        for name in plot(results, out_dir):
            print(f"wrote {name}")
        print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'} ({results['elapsed_s'] / 60:.1f} min)")
    return 0


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
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
    ax.set_yscale("log")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("training perplexity (x: evaluation)")
    ax.set_title(f"{main['topology']['name']}: {results['settings']['model']}, same samples, "
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
        ax.set_yscale("log")
        ax.set_xticks(As, [str(a) for a in As])
        ax.set_xlabel("A (steps between syncs)")
        ax.set_ylabel("seconds per step")
        save(fig, ax, "a_sweep.png")
    return written


def _machine() -> dict[str, Any]:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "memory_gb": round(_mem_available() / 1e9, 1),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__}
