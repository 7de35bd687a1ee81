"""`flwr-sharded bench`: the four methods side by side on an emulated tiered cluster (see `netemu`).

    flwr-sharded bench [--cluster FILE] [--contrast FILE] [--quick] [--out DIR]     # the full benchmark
    flwr-sharded bench exec --cluster FILE [--nproc N] -- CMD ARGS...              # any command, one per rank
    flwr-sharded bench sync [--bandwidths 100Mbit,1Gbit] [--federations 2]          # benchmarks/sync_bench.py

The full benchmark builds the cluster of `--cluster` with network namespaces, bridges and tbf (inside
`unshare --net --mount --pid`: needs root, leaves nothing behind), then trains FSDP, HSDP, FL+FSDP, FL+HSDP and
the no-sync limit (FL+FSDP with syncing off) on the same model, samples and seed, one after the other, with
`train.py --measure-traffic`. It reports per-method step times (median over windows of A steps, each holding one
sync), a phase breakdown like the paper's Table 4, speedups, the no-sync gap, bytes per tier measured (collectives
and wire) against the cost model, a sweep of A, an equal-samples learning comparison like Table 3, the planner's
choice next to the measured-fastest method (also on the `--contrast` cluster), a JSON file and time-to-perplexity
and A-sweep plots.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from flwr_sharded.config import METHODS, SYNC_DTYPE_BYTES

from flwr_sharded.errors import ConfigError
from flwr_sharded.perf import netemu
from flwr_sharded.perf.costmodel import TIERS, Placement, Units, check_layout

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CLUSTER = REPO / "examples" / "clusters" / "emulated.yaml"
DEFAULT_CONTRAST = REPO / "benchmarks" / "clusters" / "emulated-flat.yaml"
SYNC_BENCH = REPO / "benchmarks" / "sync_bench.py"
ARGS_ENV = "FLWR_SHARDED_BENCH_ARGS"
LABELS = {"fsdp": "FSDP", "hsdp": "HSDP", "fl-fsdp": "FL+FSDP", "fl-hsdp": "FL+HSDP", "no-sync": "FL+FSDP no-sync"}


# ---------------------------------------------------------------------------------------------------------------------
# Layouts.


@dataclass(frozen=True)
class Layout:
    """One method's (F, R, S) on the emulated cluster."""

    method: str
    F: int
    R: int
    S: int

    @property
    def world(self) -> int:
        return self.F * self.R * self.S

    def text(self) -> str:
        return f"{self.F}x{self.R}x{self.S}"

    def train_args(self, A: int, sync_dtype: str = "float32") -> list[str]:
        fl = self.method.startswith("fl-")
        return ["--method", self.method, "--federations", str(self.F), "--replicas", str(self.R),
                "--shards", str(self.S), "--aggregate-every", str(A if fl else 1),
                *(["--sync-dtype", sync_dtype] if fl else [])]


def default_layouts(topo: netemu.EmuTopology) -> dict[str, Layout]:
    """The paper's pattern: shard inside a node; HSDP replicates over nodes; FL+FSDP federates nodes; FL+HSDP
    replicates over the nodes of a group and federates groups (or halves of the nodes with a single group)."""
    P, N, W = topo.ranks_per_node, topo.nodes, topo.world_size
    out = {"fsdp": Layout("fsdp", 1, 1, W)}
    if N > 1:
        out["hsdp"] = Layout("hsdp", 1, N, P)
        out["fl-fsdp"] = Layout("fl-fsdp", N, 1, P)
    if topo.groups > 1 and topo.nodes_per_group > 1:
        out["fl-hsdp"] = Layout("fl-hsdp", topo.groups, topo.nodes_per_group, P)
    elif N >= 4 and N % 2 == 0:
        out["fl-hsdp"] = Layout("fl-hsdp", 2, N // 2, P)
    return out


def parse_layouts(text: str | None, topo: netemu.EmuTopology) -> dict[str, Layout]:
    """`fsdp=1x1x8,fl-fsdp=4x1x2`: overrides of the default layouts (F x R x S)."""
    layouts = default_layouts(topo)
    if not text:
        return layouts
    for item in text.split(","):
        method, _, dims = item.strip().partition("=")
        if method not in METHODS:
            raise ConfigError(f"--layouts: unknown method {method!r} in {item!r}; use {', '.join(METHODS)}")
        try:
            F, R, S = (int(x) for x in dims.lower().split("x"))
        except ValueError:
            raise ConfigError(f"--layouts: expected METHOD=FxRxS such as fl-fsdp=4x1x2, got {item!r}") from None
        check_layout(method, S=S, R=R, F=F)
        if method in ("hsdp", "fl-hsdp") and R < 2 or method.startswith("fl-") and F < 2:
            raise ConfigError(f"--layouts: {item} is not a {method} layout (needs "
                              f"{'R > 1' if 'hsdp' in method else ''}{' and ' if method == 'fl-hsdp' else ''}"
                              f"{'F > 1' if method.startswith('fl-') else ''})")
        layouts[method] = Layout(method, F, R, S)
    for layout in layouts.values():
        if layout.world != topo.world_size:
            raise ConfigError(f"--layouts: {layout.method} {layout.text()} has {layout.world} ranks, the emulated "
                              f"cluster {topo.world_size}")
    return layouts


# ---------------------------------------------------------------------------------------------------------------------
# Model units (bytes of each FSDP2 unit, padded as FSDP2 pads shards).


def model_units(model_name: str, vocab_size: int, seq_len: int, S: int, bytes_per_param: int = 4) -> Units:
    """Units of the model the engine builds, each parameter's dim 0 padded to a multiple of S (as FSDP2 does)."""
    from flwr_sharded.training.models import build_model, transformer_blocks

    model = build_model(model_name, vocab_size=vocab_size, max_seq_len=seq_len)

    def padded(params) -> float:
        total = 0
        for p in params:
            rows = p.shape[0] if p.dim() else 1
            rest = p.numel() // max(rows, 1)
            total += math.ceil(rows / S) * S * rest
        return float(total * bytes_per_param)

    blocks = transformer_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = padded(p for p in model.parameters() if id(p) not in in_blocks)
    return Units(blocks=tuple(padded(b.parameters()) for b in blocks), root=root)


def vocab_size_of(data_dir: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(Path(data_dir) / "tokenizer"))


# ---------------------------------------------------------------------------------------------------------------------
# One training run on the emulated cluster.


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


PHASE_NAMES = ("forward", "backward", "optimizer", "sync")


def summarize_metrics(path: Path) -> dict[str, Any]:
    """Windows, curves and final perplexities from a run's JSON-lines metrics (rank 0)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    config = next((r for r in records if r.get("kind") == "config"), {})
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


def run_training(fab: netemu.Fabric, layout: Layout, opts: argparse.Namespace, *, A: int, steps: int,
                 sync: bool = True, label: str | None = None, log_every: int | None = None,
                 units: Units | None = None, work: Path) -> dict[str, Any]:
    """Train one layout on the fabric; return its summary with measured and predicted traffic per tier."""
    from flwr_sharded.perf.traffic_report import compare, load_probes

    topo = fab.topology
    label = label or layout.method
    run_dir = work / f"{label}-A{A}-{steps}"
    metrics, traffic_dir = run_dir / "metrics.jsonl", run_dir / "traffic"
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics.unlink(missing_ok=True)
    log_every = log_every or A
    argv = [sys.executable, "-m", "flwr_sharded.train", *layout.train_args(A, opts.sync_dtype), "--model", opts.model,
            "--seq-len", str(opts.seq_len), "--batch-size", str(opts.batch_size), "--steps", str(steps),
            "--lr", str(opts.lr), "--seed", str(opts.seed), "--log-every", str(log_every),
            "--eval-every", str(opts.eval_every), "--eval-blocks", str(opts.eval_blocks),
            "--data-dir", opts.data_dir, "--no-progress", "--metrics", str(metrics),
            "--measure-traffic", str(traffic_dir), "--timeout", str(opts.collective_timeout)]
    if not sync:
        argv.append("--no-sync")
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    fab.run_ranks(argv, world=layout.world, timeout=opts.run_timeout, log_dir=run_dir / "logs")
    wall = time.perf_counter() - start
    summary = summarize_metrics(metrics)
    out = {"label": label, "method": layout.method, "layout": layout.text(), "F": layout.F, "R": layout.R,
           "S": layout.S, "A": A if layout.method.startswith("fl-") else 1, "sync": sync, "steps": steps,
           "wall_s": wall, "load_avg": [load_before, os.getloadavg()[0]], **summary,
           **step_stats([summary["windows"]]), "repeats": 1}
    if units is not None:
        placement = Placement(F=layout.F, R=layout.R, S=layout.S, gpus_per_node=topo.ranks_per_node,
                              nodes_per_group=topo.nodes_per_group)
        cmp = compare(load_probes(traffic_dir), layout.method, placement, units, A=out["A"], backend="gloo",
                      reshard_root=True, ranks_per_node=topo.ranks_per_node, uplinks=topo.uplinks(),
                      wire_ratio=SYNC_DTYPE_BYTES[opts.sync_dtype] / 4)  # the units are fp32 (4 bytes per parameter)
        out["traffic"] = cmp.to_dict()
        out["traffic_max_error"] = cmp.max_error()
    return out


def _say(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Planner agreement.


def planner_view(cluster_path: Path, layouts: dict[str, Layout], opts: argparse.Namespace, vocab: int,
                 A: int) -> dict[str, Any]:
    """The planner on the same cluster YAML: its first choice, and its prediction and ranking of the measured
    layouts (ranked as `plan` ranks: FL candidates count `fl_margin` slower)."""
    from flwr_sharded.perf.planner import evaluate, load_cluster, plan

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
    # the same A as the measured FL runs: a larger A always predicts faster (and drifts more)
    candidates = plan(cluster, shape, aggregate_every_options=(A,), fl_margin=margin, memory_fraction=1.0, **kw)
    first = candidates[0] if candidates else None
    return {"cluster": cluster.name, "first_choice": None if first is None else
            {"method": first.method, "F": first.F, "R": first.R, "S": first.S, "A": first.A,
             "predicted_step_s": first.step_time},
            "measured_layouts": rows, "predicted_order": order, "fl_margin": margin}


def _shape(model: str, vocab: int):
    from flwr_sharded.perf.planner import model_from_preset

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
    topo = netemu.load_topology(cluster_path)
    layouts = parse_layouts(opts.layouts if main else None, topo)
    A = opts.aggregate_every
    result: dict[str, Any] = {"name": name, "cluster_file": str(cluster_path), "topology": netemu.topology_dict(topo),
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
    jobs: dict[str, tuple[Layout, int, bool]] = {}
    for key, lay in layouts.items():
        if key in opts.method_list:
            jobs[key] = (lay, A if key.startswith("fl-") else 1, True)
    if main and "no-sync" in opts.method_list and "fl-fsdp" in layouts:
        jobs["no-sync"] = (layouts["fl-fsdp"], A, False)
    first = plan["first_choice"]
    if opts.measure_planner_choice and first:
        lay = Layout(first["method"], first["F"], first["R"], first["S"])
        if not any(j == (lay, first["A"], True) for j in jobs.values()):
            jobs["planner-choice"] = (lay, first["A"], True)
    _say(f"\n== scenario {name}: {topo.describe()}; {steps} steps per run, {repeats} repeat(s)")
    for note in topo.notes:
        _say(f"   note: {note}")
    collected: dict[str, list[dict[str, Any]]] = {k: [] for k in jobs}
    with netemu.Fabric(topo) as fab:
        for rep in range(repeats):
            order = list(jobs) if rep % 2 == 0 else list(reversed(jobs))  # interleave: ABC, CBA, ...
            for key in order:
                lay, a, sync = jobs[key]
                _say(f"-- {LABELS.get(key, key)} {lay.method} {lay.text()} A={a} (repeat {rep + 1}) ...")
                # windows of the benchmark's A steps for every method: each holds one sync of the FL runs
                run = run_training(fab, lay, opts, A=a, steps=steps, sync=sync, label=f"{key}-r{rep}",
                                   log_every=max(a, opts.aggregate_every), units=units(lay.S), work=work / name)
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
    netemu.enter_private_run()
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
        results["scenarios"]["main"] = _scenario("main", Path(opts.cluster), opts, work, vocab, main=True,
                                                 steps=opts.steps, repeats=opts.repeats)
        if opts.contrast:
            results["scenarios"]["contrast"] = _scenario("contrast", Path(opts.contrast), opts, work, vocab,
                                                         main=False, steps=opts.contrast_steps or opts.steps,
                                                         repeats=opts.contrast_repeats,
                                                         batch_size=opts.contrast_batch_size)
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


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(type(value).__name__)


def _machine() -> dict[str, Any]:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "memory_gb": round(netemu._mem_available() / 1e9, 1),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__}


# ---------------------------------------------------------------------------------------------------------------------
# Checks against the issue's targets, and the report.


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with its measured value and whether it holds."""
    out = []
    main = results["scenarios"]["main"]
    runs = main["runs"]

    def add(name: str, value: float | None, kind: str, target: str, ok: bool | None) -> None:
        out.append({"check": name, "value": value, "kind": kind, "target": target, "ok": ok})

    if "fsdp" in runs and "fl-fsdp" in runs:
        v = runs["fsdp"]["step_s"] / runs["fl-fsdp"]["step_s"]
        add("FL+FSDP speedup over FSDP (median step time)", v, "ratio", ">= 5x", v >= 5)
    if "hsdp" in runs and "fl-hsdp" in runs:
        v = runs["hsdp"]["step_s"] / runs["fl-hsdp"]["step_s"]
        add("FL+HSDP speedup over HSDP (median step time)", v, "ratio", "> 1x", v > 1)
    if "no-sync" in runs and "fl-fsdp" in runs:
        v = runs["fl-fsdp"]["step_s_mean"] / runs["no-sync"]["step_s_mean"] - 1
        add("FL+FSDP above its no-sync limit (mean step time)", v, "delta", "<= +20%", v <= 0.20)
        a = runs["fl-fsdp"]
        v = a["sync_s_mean"] / (a["step_s_mean"] - a["sync_s_mean"])
        add("(same, within the FL+FSDP run: sync time over the other phases)", v, "delta", "<= +20%", v <= 0.20)
    for scen_name, scen in results["scenarios"].items():
        errors = [r["traffic_max_error"] for r in scen["runs"].values() if "traffic_max_error" in r]
        errors += [r["traffic_max_error"] for r in scen.get("sweep", []) if "traffic_max_error" in r]
        if "planner_choice_run" in scen:
            errors.append(scen["planner_choice_run"].get("traffic_max_error", 0.0))
        if errors:
            v = max(errors)
            add(f"{scen_name}: collectives vs predicted bytes per tier, worst run and tier", v, "share", "<= 5%",
                v <= 0.05)
        agree = scen.get("agreement")
        if agree:
            add(f"{scen_name}: planner's first choice = measured fastest" if agree.get("global") else
                f"{scen_name}: planner's choice among the measured methods = measured fastest", None, "text",
                agree["text"], agree["ok"])
    return out


def agreement(scen: dict[str, Any]) -> dict[str, Any] | None:
    """The planner's first choice against the measurements.

    Over all layouts: the planner's first choice (measured too when it is none of the methods' layouts) against the
    fastest measured layout. Among the methods' layouts: the planner's ranking of the measured ones against theirs.
    The planner ranks FL layouts as if `fl_margin` slower (a policy: prefer exact gradient averaging unless FL saves
    more); the text also says which layout that rule picks from the measured times when it differs.
    """
    plan = scen.get("planner")
    if not plan:
        return None
    margin = plan["fl_margin"]
    measured = {k: r for k, r in scen["runs"].items() if r["sync"]}
    if "planner_choice_run" in scen:
        measured["planner-choice"] = scen["planner_choice_run"]
    if not measured:
        return None

    def name(k: str) -> str:
        r = measured[k]
        return f"{r['method']} {r['layout']} A={r['A']}"

    def rule(keys: list[str]) -> str:
        return min(keys, key=lambda k: measured[k]["step_s"] * (1 + margin if measured[k]["method"].startswith("fl-")
                                                                 else 1))

    fastest = min(measured, key=lambda k: measured[k]["step_s"])
    first = plan["first_choice"]
    choice = None
    if "planner-choice" in measured:
        choice = "planner-choice"
    elif first is not None:
        choice = next((k for k, r in measured.items() if (r["method"], r["F"], r["R"], r["S"], r["A"]) ==
                       (first["method"], first["F"], first["R"], first["S"], first["A"])), None)
    methods = [k for k in plan["predicted_order"] if k in measured]
    restricted = methods[0] if methods else None
    restricted_fastest = min(methods, key=lambda k: measured[k]["step_s"]) if methods else None
    out: dict[str, Any] = {"methods_only": {"planner": restricted, "measured_fastest": restricted_fastest,
                                            "ok": restricted is not None and restricted == restricted_fastest}}
    if choice is None:
        text = (f"the planner's first choice ({first['method']} {first['F']}x{first['R']}x{first['S']} A={first['A']}) "
                f"was not measured; among the measured methods: planner {LABELS.get(restricted, restricted)}, "
                f"measured fastest {LABELS.get(restricted_fastest, restricted_fastest)}") if first else "no choice"
        return {**out, "planner": restricted, "measured_fastest": restricted_fastest, "gap": None,
                "ok": out["methods_only"]["ok"], "global": False, "text": text}
    gap = measured[choice]["step_s"] / measured[fastest]["step_s"] - 1
    text = f"planner: {name(choice)}; measured fastest: {name(fastest)}"
    if choice != fastest:
        text += f" ({gap:+.1%} against the choice)"
    by_rule = rule(list(measured))
    if by_rule != fastest:
        text += f"; the planner's {margin:.0%} FL margin applied to the measured times picks {name(by_rule)}"
    return {**out, "planner": choice, "measured_fastest": fastest, "measured_by_rule": by_rule, "gap": gap,
            "ok": choice == fastest, "ok_by_rule": choice == by_rule, "global": True, "text": text}


def rerender(out_dir: str | Path) -> str:
    """Recompute checks and agreement of a saved `bench.json` and rewrite `bench.md` and the plots."""
    out_dir = Path(out_dir)
    results = json.loads((out_dir / "bench.json").read_text())
    for scen in results["scenarios"].values():
        scen["agreement"] = agreement(scen)
    results["checks"] = checks(results)
    report = render(results)
    (out_dir / "bench.json").write_text(json.dumps(results, indent=1, default=_json_default))
    (out_dir / "bench.md").write_text(report + "\n")
    plot(results, out_dir)
    return report


def _fmt(value: float | None, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _ratio(a: float | None, b: float) -> str:
    return f"{a / b:.2f}x" if a else "-"


def _rel(path: str) -> str:
    try:
        return str(Path(path).relative_to(REPO))
    except ValueError:
        return path


def _label(key: str, r: dict[str, Any]) -> str:
    return f"planner's choice ({r['method']})" if key == "planner-choice" else LABELS.get(key, key)


def render(results: dict[str, Any]) -> str:
    """Markdown tables of everything measured."""
    lines: list[str] = []
    w = lines.append
    s = results["settings"]
    m = results["machine"]
    loads = [x for scen in results["scenarios"].values() for r in [*scen["runs"].values(), *scen.get("sweep", [])]
             for x in r.get("load_avg", [])] or [float("nan")]
    w(f"# flwr-sharded bench, {results['date']}")
    w("")
    w(f"Machine: {m['cpus']} CPU cores, {m['memory_gb']} GB available, kernel {m['kernel']}, torch {m['torch']}. "
      f"Model `{s['model']}` (fp32 on CPU, gloo), lr {s['lr']}, seed {s['seed']}, A = {s['aggregate_every']}, "
      f"FL sync in {s.get('sync_dtype', 'float32')}. "
      f"Load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f} on {m['cpus']} cores. "
      f"Total {results['elapsed_s'] / 60:.1f} min.")
    for name, scen in results["scenarios"].items():
        runs = scen["runs"]
        table = dict(runs)
        if "planner_choice_run" in scen:
            table["planner-choice"] = scen["planner_choice_run"]
        w("")
        w(f"## Scenario `{name}`: {scen['description']}")
        w("")
        w(f"Cluster file `{_rel(scen['cluster_file'])}`; {scen['batch_size']} x {scen['seq_len']} tokens per rank "
          f"per step, {scen['steps']} steps per run, {scen['repeats']} repeat(s) (interleaved). "
          + " ".join(f"Note: {n}." for n in scen.get("notes", [])))
        w("")
        w("### Step time and speedups")
        w("Seconds per optimizer step over windows of A steps (each holds one sync of the FL methods), the first "
          "window of each run left out; std over windows.")
        w("")
        w("| method | F x R x S | A | median | mean | std | vs FSDP | vs HSDP | planner predicts |")
        w("|---|---|---|---|---|---|---|---|---|")
        base = runs.get("fsdp", {}).get("step_s")
        hsdp = runs.get("hsdp", {}).get("step_s")
        pl = scen.get("planner", {})
        for key, r in table.items():
            pred = pl.get("measured_layouts", {}).get(r["method"], {}).get("predicted_step_s") \
                if r["sync"] and key in pl.get("measured_layouts", {}) else None
            if key == "planner-choice":
                pred = pl["first_choice"]["predicted_step_s"]
            w(f"| {_label(key, r)} | {r['layout']} | {r['A']} | {r['step_s']:.3f} | {r['step_s_mean']:.3f} | "
              f"{r['step_s_std']:.3f} | {_ratio(base, r['step_s'])} | {_ratio(hsdp, r['step_s'])} | {_fmt(pred)} |")
        w("")
        w("### Phase breakdown (like the paper's Table 4)")
        w("Seconds per step, medians over windows; sync amortised over A steps, and per sync.")
        w("")
        w("| method | forward | backward | optimizer | sync | sync per sync | overall |")
        w("|---|---|---|---|---|---|---|")
        for key, r in table.items():
            ph = r["phases"]
            per_sync = ph["sync"] * r["A"] if r["sync"] and r["method"].startswith("fl-") else 0.0
            w(f"| {_label(key, r)} | {ph['forward']:.3f} | {ph['backward']:.3f} | {ph['optimizer']:.3f} | "
              f"{ph['sync']:.3f} | {per_sync:.3f} | {r['step_s']:.3f} |")
        if "no-sync" in runs and "fl-fsdp" in runs:
            a, b = runs["fl-fsdp"], runs["no-sync"]
            w("")
            w(f"No-sync limit (the same FL+FSDP run with `--no-sync`): {b['step_s_mean']:.3f} s/step against "
              f"{a['step_s_mean']:.3f} s/step with syncs every {a['A']} steps (means): "
              f"{a['step_s_mean'] / b['step_s_mean'] - 1:+.1%}; medians {b['step_s']:.3f} / {a['step_s']:.3f}. "
              f"Within the FL+FSDP run itself, the sync takes {a['sync_s_mean']:.3f} of its {a['step_s_mean']:.3f} "
              f"s/step: {a['sync_s_mean'] / (a['step_s_mean'] - a['sync_s_mean']):+.1%} over its other phases "
              f"(independent of load changes between runs).")
        w("")
        w("### Bytes per tier: predicted vs measured (MB, summed over ranks)")
        w("*Predicted*: `costmodel.traffic` for the run's steps and syncs (gloo: a reduce-scatter sends what an "
          "all-reduce sends; FSDP2 reshards the root after forward, so it is all-gathered twice per step). "
          "*Collectives*: the TrafficMeter's records of those steps and syncs with the same ring rules. "
          "*Wire*: interface counters (node `lo`, node `eth0`, group uplinks) over the whole training loop, which "
          "also holds evaluation and logging; *all* = every collective of that span. Wire bytes include TCP/IP "
          "headers and ACKs (per 64 KiB GSO packet on veths).")
        w("")
        w("| run | tier | predicted | collectives | error | all collectives | wire | wire / all |")
        w("|---|---|---|---|---|---|---|---|")
        rows = list(table.items()) + [(f"sweep A={x['A']}", x) for x in scen.get("sweep", []) if not x.get("reused")]
        for key, r in rows:
            t = r.get("traffic")
            if not t:
                continue
            for tier in TIERS:
                pred = sum(t["predicted"][ph][tier] for ph in ("step", "sync"))
                meas = sum(t["collectives"][ph][tier] for ph in ("step", "sync"))
                allm = sum(t["collectives"][ph][tier] for ph in ("step", "sync", "other"))
                wire = t["wire"][tier] if t.get("wire") else None
                if pred == 0 and meas == 0 and allm == 0:
                    continue
                w(f"| {_label(key, r)} | {tier} | {pred / 1e6:.2f} | {meas / 1e6:.2f} | "
                  f"{_fmt(t['error'][tier], '+.2%')} | {allm / 1e6:.2f} | "
                  f"{_fmt(wire / 1e6 if wire is not None else None, '.2f')} | "
                  f"{_fmt(t['wire_ratio'][tier] if allm >= 1e6 else None, '.3f')} |")
        if scen.get("sweep"):
            ref = runs.get("no-sync", {}).get("step_s_mean")
            w("")
            w("### Sweep of A (FL+FSDP): sync overhead against A")
            w("Mean seconds per step after the first window (windows of max(A, 8) steps); overhead against the "
              "no-sync limit.")
            w("")
            w("| A | steps | s/step | sync s per sync | sync s per step | overhead vs no-sync run | "
              "overhead vs own non-sync time |")
            w("|---|---|---|---|---|---|---|")
            for r in scen["sweep"]:
                over = r["step_s_mean"] / ref - 1 if ref else None
                sync_step = r["sync_s_mean"]
                own = sync_step / (r["step_s_mean"] - sync_step)
                w(f"| {r['A']} | {r['steps']} | {r['step_s_mean']:.3f} | {sync_step * r['A']:.3f} | "
                  f"{sync_step:.3f} | {_fmt(over, '+.1%')} | {own:+.1%} |")
            if ref:
                w(f"| no sync | {runs['no-sync']['steps']} | {ref:.3f} | - | - | 0 | - |")
        w("")
        w("### Learning quality with equal samples (like the paper's Table 3)")
        w("Every method trains the same number of steps on the same blocks (same seed, batch, ranks: iid "
          "partition by data-parallel rank). Train ppl: last logging window, mean over ranks; eval ppl: "
          f"{s['eval_blocks']} held-out blocks at the end; time: training time (the sum of window times).")
        w("")
        w("| method | effective batch (sequences / tokens per optimizer step) | samples seen | train ppl | "
          "eval ppl | time s |")
        w("|---|---|---|---|---|---|")
        for key, r in table.items():
            samples = r["steps"] * scen["batch_size"] * (r["F"] * r["R"] * r["S"])
            w(f"| {_label(key, r)} | {r['effective_batch']} / {r['effective_batch_tokens']} | {samples} | "
              f"{_fmt(r['final']['train_ppl'], '.1f')} | {_fmt(r['final']['eval_ppl'], '.1f')} | "
              f"{r['final']['train_time_s']:.1f} |")
        if pl:
            w("")
            w(f"### Planner agreement (`plan` on `{_rel(scen['cluster_file'])}`, the same model, tokens and vocabulary, "
              f"fl_margin {pl['fl_margin']:.0%})")
            w("")
            order = pl["predicted_order"]
            measured_order = sorted((k for k in runs if runs[k]["sync"]), key=lambda k: runs[k]["step_s"])
            w(f"- predicted order of the methods' layouts (FL counted {pl['fl_margin']:.0%} slower): "
              f"{' < '.join(LABELS[k] for k in order)}")
            w(f"- measured order: {' < '.join(LABELS[k] for k in measured_order)}")
            fc = pl["first_choice"]
            if fc:
                line = (f"- planner's first choice over all layouts: {fc['method']} F={fc['F']} R={fc['R']} S={fc['S']} "
                        f"A={fc['A']}, {fc['predicted_step_s']:.3f} s/step predicted")
                if "planner_choice_run" in scen:
                    line += f", {scen['planner_choice_run']['step_s']:.3f} s/step measured"
                w(line)
            agree = scen.get("agreement")
            if agree:
                w(f"- {agree['text']}: {'agree' if agree['ok'] else 'disagree'}")
                mo = agree["methods_only"]
                if agree.get("global") and mo["planner"]:
                    w(f"- among the methods' layouts only: planner {LABELS[mo['planner']]}, measured fastest "
                      f"{LABELS[mo['measured_fastest']]}: {'agree' if mo['ok'] else 'disagree'}")
    w("")
    w("## Targets")
    w("")
    w("| check | measured | target | holds |")
    w("|---|---|---|---|")
    for c in results["checks"]:
        value, kind = c["value"], c["kind"]
        v = "-" if value is None else f"{value:.2f}x" if kind == "ratio" else f"{value:+.1%}" if kind == "delta" \
            else f"{value:.2%}"
        w(f"| {c['check']} | {v} | {c['target']} | {'yes' if c['ok'] else 'no'} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """time_to_ppl.png (training perplexity against training time, like the paper's Figure 2) and a_sweep.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("matplotlib is not installed: no plots (pip install 'flwr_sharded[plot]')")
        return []
    written = []
    main = results["scenarios"]["main"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, r in main["runs"].items():
        xs = [p["time_s"] for p in r["train"]]
        ys = [p["ppl"] for p in r["train"]]
        line, = ax.plot(xs, ys, "--" if key == "no-sync" else "-", label=LABELS[key], marker=".")
        if r["eval"]:
            ax.plot([e["time_s"] for e in r["eval"]], [e["eval_ppl"] for e in r["eval"]], "x", color=line.get_color(),
                    markersize=8)
    ax.set_yscale("log")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("training perplexity (x: evaluation)")
    ax.set_title(f"{main['topology']['name']}: {results['settings']['model']}, same samples, A={results['settings']['aggregate_every']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "time_to_ppl.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    if main.get("sweep"):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        As = [r["A"] for r in main["sweep"]]
        sync_per_step = [max(r["sync_s_mean"], 1e-4) for r in main["sweep"]]
        steps = [r["step_s_mean"] for r in main["sweep"]]
        ax.plot(As, steps, "o-", label="FL+FSDP s/step")
        ax.plot(As, sync_per_step, "s--", label="of which sync (s/step)")
        if "no-sync" in main["runs"]:
            ax.axhline(main["runs"]["no-sync"]["step_s_mean"], linestyle="--", color="gray", label="no-sync limit")
        if "fsdp" in main["runs"]:
            ax.axhline(main["runs"]["fsdp"]["step_s_mean"], linestyle=":", color="red", label="FSDP")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(As, [str(a) for a in As])
        ax.set_xlabel("A (steps between syncs)")
        ax.set_ylabel("seconds per step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / "a_sweep.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------------------------------
# `bench exec` and `bench sync`.


def _inner_exec(opts: argparse.Namespace) -> int:
    netemu.enter_private_run()
    topo = netemu.load_topology(opts.cluster)
    nproc = opts.nproc or topo.world_size
    with netemu.Fabric(topo) as fab:
        try:
            results = fab.run_ranks(list(opts.cmd), world=nproc, timeout=opts.run_timeout, log_dir=opts.log_dir)
        except netemu.RankFailure as exc:
            print(f"flwr-sharded bench exec: error: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(results[0].stdout)
    sys.stderr.write(results[0].stderr[-4000:])
    return 0


def link_checks(topo: netemu.EmuTopology) -> list[tuple[str, int, int, float | None]]:
    """(tier, source node, destination node, configured bits/s) for one transfer on each tier."""
    out: list[tuple[str, int, int, float | None]] = []
    if topo.ranks_per_node > 1:
        out.append(("intra_node", 0, 0, None))
    if topo.nodes_per_group > 1:
        out.append(("inter_node", 0, 1, topo.inter_node_bps))
    if topo.groups > 1:
        out.append(("inter_group", 0, topo.nodes_per_group, topo.inter_group_bps))
    return out


def check_links(fab: netemu.Fabric, seconds: float = 0.5) -> list[dict[str, Any]]:
    """Time one TCP transfer per tier; shaped tiers should come out a little under their tbf rate."""
    rows = []
    for i, (tier, a, b, bps) in enumerate(link_checks(fab.topology)):
        nbytes = max(1 << 20, int((bps or 4e9) / 8 * seconds))
        secs = netemu.measure_transfer(fab, a, b, nbytes, port=5201 + i)
        measured = nbytes * 8 / secs
        rows.append({"tier": tier, "from_node": a, "to_node": b, "bytes": nbytes, "seconds": secs,
                     "measured_bps": measured, "configured_bps": bps,
                     "ratio": measured / bps if bps else None,
                     "ok": None if not bps else 0.7 <= measured / bps <= 1.05})
    return rows


def _inner_check(opts: argparse.Namespace) -> int:
    netemu.enter_private_run()
    topo = netemu.load_topology(opts.cluster)
    with netemu.Fabric(topo) as fab:
        rows = check_links(fab, opts.seconds)
    if opts.json:
        print(json.dumps({"topology": netemu.topology_dict(topo), "links": rows}, indent=1))
        return 0
    print(topo.describe())
    print("| tier | nodes | MB | seconds | measured | configured | measured / configured |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tier']} | {r['from_node']} -> {r['to_node']} | {r['bytes'] / 1e6:.1f} | {r['seconds']:.3f} | "
              f"{netemu._rate(r['measured_bps'])} | {netemu._rate(r['configured_bps']) if r['configured_bps'] else 'unshaped'}"
              f" | {_fmt(r['ratio'], '.3f')} |")
    return 0 if all(r["ok"] in (None, True) for r in rows) else 1


def sync_topologies(F: int, S: int, bandwidths: Sequence[float]) -> list[tuple[str, netemu.EmuTopology]]:
    """Loopback (all ranks on one node) and F nodes in F groups, the group uplinks at each bandwidth."""
    out = [("loopback", netemu.EmuTopology(name="loopback", ranks_per_node=F * S, nodes=1, nodes_per_group=1,
                                           inter_node_bps=None, inter_group_bps=None))]
    for bw in bandwidths:
        name = netemu._rate(bw).replace(" ", "").replace("/s", "")
        out.append((name, netemu.EmuTopology(name=name, ranks_per_node=S, nodes=F, nodes_per_group=1,
                                             inter_node_bps=None, inter_group_bps=bw)))
    return out


def _inner_sync(opts: argparse.Namespace) -> int:
    netemu.enter_private_run()
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, topo in sync_topologies(opts.federations, opts.shards, opts.bandwidth_values):
        path = out_dir / f"sync_emulated_F{opts.federations}_S{opts.shards}_h{opts.hidden}_{name}.json"
        argv = [sys.executable, str(SYNC_BENCH), "--federations", str(opts.federations), "--shards", str(opts.shards),
                "--layers", str(opts.layers), "--hidden", str(opts.hidden), "--repeats", str(opts.repeats),
                "--out", str(path), *opts.extra]
        _say(f"-- sync_bench on {topo.describe()} ...")
        with netemu.Fabric(topo) as fab:
            fab.run_ranks(argv, timeout=opts.run_timeout)
        res = json.loads(path.read_text())
        res["network"] = name
        res["topology"] = netemu.topology_dict(topo)
        path.write_text(json.dumps(res, indent=2))
        rows.append(res)
        _say(f"   sync/flat {res['sync_over_flat']:.3f}")
    print("\n| network | shard bytes/rank | sync s | flat s | per-param s | sync / flat | per-param / sync |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        med = r["median_s"]
        print(f"| {r['network']} | {r['shard_bytes_per_rank']:,} | {med['sync']:.4f} | {med['flat']:.4f} | "
              f"{med['per-param']:.4f} | {r['sync_over_flat']:.3f} | {r['per_param_over_sync']:.2f} |")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# Command line.


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


RUN_KEYS = ("fsdp", "hsdp", "fl-fsdp", "fl-hsdp", "no-sync")


def _method_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in RUN_KEYS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"choose among {','.join(RUN_KEYS)}, got {text!r}")
    return values


def _bandwidths(text: str) -> list[float]:
    from flwr_sharded.perf.planner import parse_bandwidth

    try:
        return [parse_bandwidth(x.strip(), "--bandwidths") for x in text.split(",") if x.strip()]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` sub-command (and its `exec` and `sync` sub-commands)."""
    from flwr_sharded.config import default_data_dir

    p = subparsers.add_parser(
        "bench", help="run the four methods side by side on an emulated tiered network (root; Linux netns + tc)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default=str(DEFAULT_CLUSTER), metavar="FILE",
                   help="cluster YAML to emulate (default examples/clusters/emulated.yaml)")
    p.add_argument("--contrast", default=str(DEFAULT_CONTRAST), metavar="FILE",
                   help="a contrasting cluster for the planner check (default benchmarks/clusters/emulated-flat.yaml); "
                        "'none' to skip")
    p.add_argument("--layouts", default=None, metavar="LIST",
                   help="override layouts of the main cluster, e.g. fsdp=1x1x8,fl-fsdp=4x1x2 (F x R x S)")
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--steps", type=int, default=32, help="optimizer steps of each run (default 32)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each method on the main cluster, interleaved")
    p.add_argument("--contrast-steps", type=int, default=32, help="steps per run on the contrasting cluster (32)")
    p.add_argument("--contrast-repeats", type=int, default=1,
                   help="runs of each method on the contrasting cluster, interleaved (default 1)")
    p.add_argument("--contrast-batch-size", type=int, default=4,
                   help="sequences per rank per step on the contrasting cluster (default 4: compute-heavy, so "
                        "communication is a small part of a step)")
    p.add_argument("--methods", type=_method_list, default=list(RUN_KEYS), dest="method_list", metavar="LIST",
                   help=f"runs to do, among {','.join(RUN_KEYS)} (default all)")
    p.add_argument("--aggregate-every", type=int, default=8, help="A of the FL methods (default 8)")
    p.add_argument("--sync-dtype", choices=tuple(SYNC_DTYPE_BYTES), default="float32",
                   help="wire dtype of the FL methods' shard sync (train --sync-dtype; default float32); the "
                        "predicted sync bytes and the planner use its size")
    p.add_argument("--sweep", type=_int_list, default=[1, 2, 4, 8, 16, 32], dest="sweep_values", metavar="LIST",
                   help="values of A for the FL+FSDP sweep (default 1,2,4,8,16,32)")
    p.add_argument("--no-sweep", action="store_true", help="skip the sweep of A")
    p.add_argument("--sweep-windows", type=int, default=1,
                   help="measured windows of max(A, 8) steps per sweep point, after a warm-up window (default 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--eval-blocks", type=int, default=32)
    p.add_argument("--fl-margin", type=float, default=0.1, help="the planner's FL margin (default 0.1)")
    p.add_argument("--no-planner-run", dest="measure_planner_choice", action="store_false",
                   help="do not measure the planner's first choice when it is not among the measured layouts")
    p.add_argument("--data-dir", default=default_data_dir(), help="prepared data directory")
    p.add_argument("--out", default="bench-results", help="output directory (bench.json, bench.md, PNGs)")
    p.add_argument("--keep-runs", default=None, metavar="DIR", help="keep each run's metrics, traffic and logs here")
    p.add_argument("--date", default=None, help="date printed in the report (default today)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 8 steps, A=2, no sweep, no contrast, no planner run (for tests)")
    p.add_argument("--run-timeout", type=float, default=1200.0, help="seconds one training run may take")
    p.add_argument("--collective-timeout", type=float, default=300.0, help="seconds one collective may take")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the whole benchmark may take")
    p.set_defaults(func=run, bench_command=None)
    sub = p.add_subparsers(dest="bench_command")

    e = sub.add_parser("exec", help="run a command once per rank on the emulated cluster (RANK, WORLD_SIZE, "
                                    "MASTER_ADDR, GLOO_SOCKET_IFNAME set), e.g. a torchrun-style script")
    e.add_argument("--cluster", required=True, metavar="FILE", dest="exec_cluster")
    e.add_argument("--nproc", type=int, default=None, help="ranks (default: all of the cluster)")
    e.add_argument("--log-dir", default=None, help="keep each rank's stdout/stderr here")
    e.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    e.set_defaults(func=run_exec)

    c = sub.add_parser("check", help="measure the emulated links' throughput against the description")
    c.add_argument("--cluster", required=True, metavar="FILE", dest="exec_cluster")
    c.add_argument("--seconds", type=float, default=0.5, help="target duration of each transfer (default 0.5)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=run_check)

    s = sub.add_parser("sync", help="benchmarks/sync_bench.py on loopback and across shaped inter-group links")
    s.add_argument("--federations", type=int, default=2)
    s.add_argument("--shards", type=int, default=1)
    s.add_argument("--bandwidths", type=_bandwidths, default=[1e8, 1e9], dest="bandwidth_values",
                   help="inter-group bandwidths (default 100Mbit,1Gbit)")
    s.add_argument("--layers", type=int, default=16)
    s.add_argument("--hidden", type=int, default=64)
    s.add_argument("--repeats", type=int, default=20)
    s.add_argument("--sync-out", default="benchmarks/results", dest="sync_out", help="directory for the JSON files")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="-- more sync_bench.py arguments")
    s.set_defaults(func=run_sync)
    return p


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.seq_len, args.batch_size, args.steps = "tiny", 32, 1, 8
        args.aggregate_every, args.eval_every, args.eval_blocks = 2, 4, 8
        args.sweep_values, args.contrast, args.measure_planner_choice = [], None, False
        args.repeats = 1
        args.sweep_windows = 1
    if args.no_sweep:
        args.sweep_values = []
    if args.contrast in ("none", ""):
        args.contrast = None


def _validate(args: argparse.Namespace) -> None:
    """Everything that can be checked before touching the network: cluster files, layouts, model, data, host."""
    from flwr_sharded.config import DataConfig
    from flwr_sharded.training.data import check_data
    from flwr_sharded.training.models import PRESETS

    for option, value in (("--steps", args.steps), ("--seq-len", args.seq_len), ("--batch-size", args.batch_size),
                          ("--aggregate-every", args.aggregate_every), ("--sweep-windows", args.sweep_windows),
                          ("--repeats", args.repeats), ("--contrast-repeats", args.contrast_repeats),
                          ("--contrast-steps", args.contrast_steps),
                          ("--contrast-batch-size", args.contrast_batch_size)):
        if value < 1:
            raise ConfigError(f"{option} must be >= 1, got {value}")
    if args.model not in PRESETS:
        raise ConfigError(f"--model: the benchmark needs a preset to predict its traffic; got {args.model!r}, "
                          f"choose one of {', '.join(PRESETS)}")
    for option, path in (("--cluster", args.cluster), ("--contrast", args.contrast)):
        if path is None:
            continue
        topo = netemu.load_topology(path)
        layouts = parse_layouts(args.layouts if option == "--cluster" else None, topo)
        if option == "--cluster" and "fl-fsdp" not in layouts:
            raise ConfigError(f"--cluster {path}: a single node has no FL+FSDP layout to benchmark; describe at "
                              f"least 2 nodes")
    check_data(DataConfig(data_dir=args.data_dir))
    netemu.check_host()


def run(args: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench`."""
    _apply_quick(args)
    if netemu.inside():
        return _inner_main(args)
    try:
        _validate(args)
    except ConfigError as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 2
    args.out = str(Path(args.out).resolve())
    args.data_dir = str(Path(args.data_dir).expanduser().resolve())
    for name in ("cluster", "contrast", "keep_runs"):
        if getattr(args, name):
            setattr(args, name, str(Path(getattr(args, name)).resolve()))
    return _reexec(args, "main")


def run_exec(args: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench exec`."""
    args.cluster = args.exec_cluster
    if args.cmd and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    if netemu.inside():
        return _inner_exec(args)
    try:
        if not args.cmd:
            raise ConfigError("bench exec: give a command after --, e.g. -- python script.py")
        topo = netemu.load_topology(args.cluster)
        if args.nproc is not None and not 1 <= args.nproc <= topo.world_size:
            raise ConfigError(f"--nproc {args.nproc}: the cluster has {topo.world_size} ranks")
        netemu.check_host()
    except ConfigError as exc:
        print(f"flwr-sharded bench exec: error: {exc}", file=sys.stderr)
        return 2
    args.cluster = str(Path(args.cluster).resolve())
    return _reexec(args, "exec")


def run_check(args: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench check`."""
    args.cluster = args.exec_cluster
    if netemu.inside():
        return _inner_check(args)
    try:
        netemu.load_topology(args.cluster)
        netemu.check_host()
    except ConfigError as exc:
        print(f"flwr-sharded bench check: error: {exc}", file=sys.stderr)
        return 2
    args.cluster = str(Path(args.cluster).resolve())
    return _reexec(args, "check")


def run_sync(args: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench sync`."""
    args.extra = args.extra[1:] if args.extra and args.extra[0] == "--" else args.extra
    args.out = str(Path(args.sync_out).resolve())
    if netemu.inside():
        return _inner_sync(args)
    try:
        for name, topo in sync_topologies(args.federations, args.shards, args.bandwidth_values):
            topo.check_fits()
        netemu.check_host()
    except ConfigError as exc:
        print(f"flwr-sharded bench sync: error: {exc}", file=sys.stderr)
        return 2
    return _reexec(args, "sync")


def _reexec(args: argparse.Namespace, mode: str) -> int:
    """Run this sub-command again inside fresh namespaces; check that nothing is left on the host afterwards."""
    payload = {k: v for k, v in vars(args).items() if k != "func"}
    payload["mode"] = mode
    try:
        result = netemu.run_isolated([sys.executable, "-m", "flwr_sharded.perf.bench"],
                                     env={ARGS_ENV: json.dumps(payload)}, timeout=args.timeout)
    except TimeoutError as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 1
    except netemu.EmulationError as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 2
    left = netemu.host_leftovers()
    if any(left.values()):
        print(f"flwr-sharded bench: warning: left on the host: {left}", file=sys.stderr)
    return result.returncode


def _inner_entry() -> int:
    """`python -m flwr_sharded.perf.bench`, started by `_reexec` inside the namespaces."""
    payload = json.loads(os.environ[ARGS_ENV])
    mode = payload.pop("mode")
    args = argparse.Namespace(**payload)
    try:
        if mode == "main":
            return _inner_main(args)
        if mode == "exec":
            return _inner_exec(args)
        if mode == "check":
            return _inner_check(args)
        return _inner_sync(args)
    except (ConfigError, netemu.RankFailure) as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(_inner_entry())
