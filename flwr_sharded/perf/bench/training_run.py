"""One training run on the emulated cluster: the trainer on the fabric's ranks, and what its metrics say (windows of
steps, loss and perplexity curves, step-time statistics)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from flwr_sharded.parallel.wire import sync_wire_ratio
from flwr_sharded.perf.bench.layouts import BenchLayout, SyncVariant
from flwr_sharded.perf.costmodel import Units
from flwr_sharded.perf.netemu.network import Fabric, RankFailure
from flwr_sharded.perf.placement import Placement


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


def run_training(fab: Fabric, layout: BenchLayout, opts: argparse.Namespace, *, A: int, steps: int,
                 sync: bool = True, label: str | None = None, log_every: int | None = None,
                 units: Units | None = None, work: Path, variant: SyncVariant | None = None,
                 extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """Train one layout on the fabric (its metrics, traffic and logs in `run_dir` under `work`); its summary, with
    measured and predicted traffic per tier given the model's `units` (a layout of equal groups). `variant`: how an
    FL layout syncs (default: `--sync-dtype`, blocking); `extra_args`: more trainer flags."""
    from flwr_sharded.perf.traffic_report import compare, load_probes

    topo, label = fab.topology, label or layout.method
    run_dir = work / f"{label}-A{A}-{steps}"
    outputs, traffic_dir = run_dir / "run", run_dir / "traffic"
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(outputs, ignore_errors=True)
    variant = variant or SyncVariant(dtype=opts.sync_dtype)
    argv = [sys.executable, "-m", "flwr_sharded.train", *layout.train_args(A, variant), "--model", opts.model,
            "--seq-len", str(opts.seq_len), "--batch-size", str(opts.batch_size), "--steps", str(steps),
            "--lr", str(opts.lr), "--seed", str(opts.seed), "--log-every", str(log_every or A),
            "--eval-every", str(opts.eval_every), "--eval-blocks", str(opts.eval_blocks),
            "--data-dir", opts.data_dir, "--no-progress", "--run-dir", str(outputs), "--no-save-model",
            "--measure-traffic", str(traffic_dir), "--timeout", str(opts.collective_timeout),
            *([] if sync else ["--no-sync"]), *extra_args]
    for attempt in (1, 2):
        start, load_before = time.perf_counter(), os.getloadavg()[0]
        try:
            fab.run_ranks(argv, world=layout.world, timeout=opts.run_timeout, log_dir=run_dir / "logs")
            break
        except RankFailure as exc:  # a native abort (a signal) is run again once, and said; anything else stops
            if attempt == 2 or exc.code is None or exc.code >= 0:
                raise
            print(f"   {label}: {str(exc).splitlines()[0]}; running it again once")
            shutil.rmtree(outputs, ignore_errors=True)
            shutil.rmtree(traffic_dir, ignore_errors=True)
    wall, fl = time.perf_counter() - start, layout.method.startswith("fl-")
    summary = summarize_metrics(outputs / "metrics.jsonl")
    out = {"label": label, "method": layout.method, "layout": layout.text(), "F": layout.F, "R": layout.R,
           "S": layout.S, "A": A if fl else 1, "sync": sync, "steps": steps,
           "sync_variant": dataclasses.asdict(variant) if fl else None, "wall_s": wall,
           "attempts": attempt, "run_dir": str(run_dir), "load_avg": [load_before, os.getloadavg()[0]], **summary,
           **step_stats([summary["windows"]]), "repeats": 1}
    if units is not None:
        placement = Placement(F=layout.F, R=layout.R, S=layout.S, gpus_per_node=topo.ranks_per_node,
                              nodes_per_group=topo.nodes_per_group)
        cmp = compare(load_probes(traffic_dir), layout.method, placement, units, A=out["A"], backend="gloo",
                      reshard_root=True, ranks_per_node=topo.ranks_per_node, uplinks=topo.uplinks(),
                      wire_ratio=sync_wire_ratio(variant.dtype, variant.topk, layout.F),  # over the fp32 units
                      fragments=variant.fragments)
        out.update(traffic=cmp.to_dict(), traffic_max_error=cmp.max_error())
    return out
