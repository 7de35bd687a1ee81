"""The bench's reports: the Markdown one (every scenario's tables: step times, phases, sync variants, time to target,
bytes per tier, the sweep of A, quality, the planner; and the targets' table, `targets`) and how bench.json writes
what JSON has no value for (`_json_default`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from flwr_sharded_perf.provenance import REPO
from flwr_sharded_perf.bench.runs import LABELS, UNEQUAL_LABELS, VARIANT_RUNS, SyncVariant
from flwr_sharded_perf.bench.targets import (bytes_ratio, cross_group_bytes_per_sync, dtype_label, model_error,
                                             time_to_target_summary)
from flwr_sharded_perf.placement import TIERS

def _json_default(value: Any) -> Any:
    """A path as its text, a float that is not finite as null."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(type(value).__name__)


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def _mb(value: float | None, spec: str) -> str:
    """Bytes as MB (`_fmt`)."""
    return _fmt(None if value is None else value / 1e6, spec)


def _ratio(a: float | None, b: float) -> str:
    return f"{a / b:.2f}x" if a else "-"


def _rel(path: str) -> str:
    try:
        return str(Path(path).relative_to(REPO))
    except ValueError:
        return path


def _section(title: str, text: str, columns: str) -> list[str]:
    """A Markdown section: its title, text and a table's header (`columns`: "a | b | c")."""
    return ["", f"### {title}", *([text] if text else []), "", f"| {columns} |",
            "|" + "---|" * (columns.count("|") + 1)]


def _label(key: str, r: dict[str, Any]) -> str:
    return f"planner's choice ({r['method']})" if key == "planner-choice" else LABELS.get(key, key)


def render_report(results: dict[str, Any]) -> str:
    """Markdown tables of everything measured."""
    lines = _header(results)
    for name, scen in results["scenarios"].items():
        lines += render_unequal(scen) if name == "unequal" else _render_scenario(name, scen, results["settings"])
    lines += ["", "## Targets", "", "| check | measured | target | holds |", "|---|---|---|---|"]
    for c in results["checks"]:
        value, kind = c["value"], c["kind"]
        v = "-" if value is None else f"{value:.2f}x" if kind == "ratio" else f"{value:+.1%}" if kind == "delta" \
            else f"{value:.2%}"
        holds = "-" if c["ok"] is None else "yes" if c["ok"] else "no"
        lines.append(f"| {c['check']} | {v} | {c['target']} | {holds} |")
    return "\n".join(lines)


def _header(results: dict[str, Any]) -> list[str]:
    s, m = results["settings"], results["machine"]
    loads = [x for scen in results["scenarios"].values() for r in [*scen["runs"].values(), *scen.get("sweep", [])]
             for x in r.get("load_avg", [])] or [float("nan")]
    return [f"# flwr-sharded bench, {results['date']}", "",
            f"Machine: {m['cpus']} CPU cores, {m['memory_gb']} GB available, kernel {m['kernel']}, torch "
            f"{m['torch']}. Model `{s['model']}` (fp32 on CPU, gloo), lr {s['lr']}, seed {s['seed']}, A = "
            f"{s['aggregate_every']}, FL sync in {s.get('sync_dtype', 'float32')}. "
            f"Load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f} on {m['cpus']} cores. "
            f"Total {results['elapsed_s'] / 60:.1f} min."]


def _render_scenario(name: str, scen: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """One scenario's sections: step times, phases, sync variants, bytes, sweep, quality, planner."""
    table = dict(scen["runs"])
    if "planner_choice_run" in scen:
        table["planner-choice"] = scen["planner_choice_run"]
    lines = ["", f"## Scenario `{name}`: {scen['description']}", "",
             f"Cluster file `{_rel(scen['cluster_file'])}`; {scen['batch_size']} x {scen['seq_len']} tokens per rank "
             f"per step, {scen['steps']} steps per run, {scen['repeats']} repeat(s) (interleaved). "
             + " ".join(f"Note: {n}." for n in scen.get("notes", []))]
    lines += _step_times(scen, table) + _phases(scen["runs"], table) + _sync_variants(scen["runs"])
    lines += _time_to_target(scen, settings)
    lines += _tier_bytes(scen, table) + _sweep(scen) + _quality(scen, table, settings["eval_blocks"])
    if scen.get("planner"):
        lines += _planner(scen)
    return lines


def _step_times(scen: dict[str, Any], table: dict[str, Any]) -> list[str]:
    runs, pl = scen["runs"], scen.get("planner", {})
    base, hsdp = runs.get("fsdp", {}).get("step_s"), runs.get("hsdp", {}).get("step_s")
    lines = _section("Step time and speedups", "Seconds per optimizer step over windows of A steps (each holds one "
                     "sync of the FL methods), the first window of each run left out; std over windows.",
                     "method | F x R x S | A | median | mean | std | vs FSDP | vs HSDP | planner predicts")
    for key, r in table.items():
        measured = pl.get("measured_layouts", {})
        pred = pl["first_choice"]["predicted_step_s"] if key == "planner-choice" else \
            pl["variants"][key]["predicted_step_s"] if key in pl.get("variants", {}) else \
            measured[r["method"]]["predicted_step_s"] if r["sync"] and key in measured else None
        lines.append(f"| {_label(key, r)} | {r['layout']} | {r['A']} | {r['step_s']:.3f} | {r['step_s_mean']:.3f} | "
                     f"{r['step_s_std']:.3f} | {_ratio(base, r['step_s'])} | {_ratio(hsdp, r['step_s'])} | "
                     f"{_fmt(pred)} |")
    return lines


def _phases(runs: dict[str, Any], table: dict[str, Any]) -> list[str]:
    lines = _section("Phase breakdown (like the paper's Table 4)", "Seconds per step, medians over windows; sync "
                     "amortised over A steps, and per sync.",
                     "method | forward | backward | optimizer | sync | sync per sync | overall")
    for key, r in table.items():
        ph = r["phases"]
        per_sync = ph["sync"] * r["A"] if r["sync"] and r["method"].startswith("fl-") else 0.0
        lines.append(f"| {_label(key, r)} | {ph['forward']:.3f} | {ph['backward']:.3f} | {ph['optimizer']:.3f} | "
                     f"{ph['sync']:.3f} | {per_sync:.3f} | {r['step_s']:.3f} |")
    if "no-sync" in runs and "fl-fsdp" in runs:
        a, b = runs["fl-fsdp"], runs["no-sync"]
        lines += ["", f"No-sync limit (the same FL+FSDP run with `--no-sync`): {b['step_s_mean']:.3f} s/step against "
                  f"{a['step_s_mean']:.3f} s/step with syncs every {a['A']} steps (means): "
                  f"{a['step_s_mean'] / b['step_s_mean'] - 1:+.1%}; medians {b['step_s']:.3f} / {a['step_s']:.3f}. "
                  f"Within the FL+FSDP run itself, the sync takes {a['sync_s_mean']:.3f} of its "
                  f"{a['step_s_mean']:.3f} s/step: {a['sync_s_mean'] / (a['step_s_mean'] - a['sync_s_mean']):+.1%} "
                  f"over its other phases (independent of load changes between runs)."]
    return lines


def _sync_variants(runs: dict[str, Any]) -> list[str]:
    variants = [k for k in ("fl-fsdp", *VARIANT_RUNS) if k in runs and runs[k].get("sync_variant")]
    if len(variants) <= 1:
        return []
    ref = runs.get("no-sync", {}).get("step_s_mean")
    base = runs.get("fsdp", {}).get("step_s")
    lines = _section("Overlapped, quantized and sparse syncs (FL+FSDP, same layout, samples and seed)",
                     "Sync per step: what the step waits for (an overlapped sync's communication runs during the next "
                     "steps). Cross-group: bytes the syncs sent over the inter-group tier per whole-model sync "
                     "(collectives, all ranks).", "run | sync | s/step median | mean | vs no-sync (means) | vs FSDP | "
                     "sync s per step | cross-group MB per sync | eval ppl")
    for key in variants:
        r = runs[key]
        lines.append(f"| {_label(key, r)} | {SyncVariant(**r['sync_variant']).text()} | {r['step_s']:.3f} | "
                     f"{r['step_s_mean']:.3f} | {_fmt(r['step_s_mean'] / ref - 1 if ref else None, '+.1%')} | "
                     f"{_ratio(base, r['step_s'])} | {r['sync_s_mean']:.3f} | "
                     f"{_mb(cross_group_bytes_per_sync(r), '.2f')} | {_fmt(r['final']['eval_ppl'], '.1f')} |")
    return lines


def _time_to_target(scen: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    summary = time_to_target_summary(scen["runs"])
    if not summary or set(summary["runs"]) <= {"fl-fsdp"}:
        return []
    ref = dtype_label(summary["reference_dtype"])
    lines = _section("Time to target on this cluster",
                     f"Target: the blocking {ref} sync's final eval ppl, {summary['target_eval_ppl']:.1f}. Time: "
                     f"training wall time (the steps and the syncs they wait for, evaluation left out) to the first "
                     f"eval at or below it, interpolated linearly in log perplexity between the eval points around it "
                     f"(`--eval-every {settings.get('eval_every')}` and the last step); `-`: not reached in the run's "
                     f"steps. Compute utilisation: the no-sync run's mean step time over the run's, "
                     f"the fraction of wall time spent computing (above 100%: load noise between runs).",
                     f"run | final eval ppl | time to {ref}'s final ppl (s) | vs {ref}'s time | compute utilisation | "
                     f"cross-group bytes per sync vs {ref}")
    for key, r in summary["runs"].items():
        vs, sent = r["vs_reference"], r["bytes_vs_reference"]
        lines.append(f"| {_label(key, scen['runs'][key])} | {_fmt(r['final_eval_ppl'], '.1f')} | "
                     f"{_fmt(r['time_to_target_s'], '.1f')} | {'-' if vs is None else f'{vs:.2f}x'} | "
                     f"{_fmt(r['compute_utilisation'], '.1%')} | {'-' if sent is None else f'{sent:.3f}x'} |")
    return lines


def _tier_bytes(scen: dict[str, Any], table: dict[str, Any]) -> list[str]:
    lines = _section("Bytes per tier: predicted vs measured (MB, summed over ranks)",
                     "*Predicted*: `placement.traffic` for the run's steps and syncs (gloo: a reduce-scatter sends "
                     "what an all-reduce sends; FSDP2 reshards the root after forward, so it is all-gathered twice per "
                     "step). *Collectives*: the TrafficMeter's records of those steps and syncs with the same ring "
                     "rules. *Wire*: interface counters (node `lo`, node `eth0`, group uplinks) over the whole "
                     "training loop, which also holds evaluation and logging; *all* = every collective of that span. "
                     "Wire bytes include TCP/IP headers and ACKs (per 64 KiB GSO packet on veths).",
                     "run | tier | predicted | collectives | error | all collectives | wire | wire / all")
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
            lines.append(f"| {_label(key, r)} | {tier} | {pred / 1e6:.2f} | {meas / 1e6:.2f} | "
                         f"{_fmt(t['error'][tier], '+.2%')} | {allm / 1e6:.2f} | "
                         f"{_mb(wire, '.2f')} | "
                         f"{_fmt(t['wire_ratio'][tier] if allm >= 1e6 else None, '.3f')} |")
    return lines


def _sweep(scen: dict[str, Any]) -> list[str]:
    if not scen.get("sweep"):
        return []
    runs = scen["runs"]
    ref = runs.get("no-sync", {}).get("step_s_mean")
    lines = _section("Sweep of A (FL+FSDP): sync overhead against A", "Mean seconds per step after the first window "
                     "(windows of max(A, 8) steps); overhead against the no-sync limit.", "A | steps | s/step | "
                     "sync s per sync | sync s per step | overhead vs no-sync run | overhead vs own non-sync time")
    for r in scen["sweep"]:
        over = r["step_s_mean"] / ref - 1 if ref else None
        sync_step = r["sync_s_mean"]
        own = sync_step / (r["step_s_mean"] - sync_step)
        lines.append(f"| {r['A']} | {r['steps']} | {r['step_s_mean']:.3f} | {sync_step * r['A']:.3f} | "
                     f"{sync_step:.3f} | {_fmt(over, '+.1%')} | {own:+.1%} |")
    if ref:
        lines.append(f"| no sync | {runs['no-sync']['steps']} | {ref:.3f} | - | - | 0 | - |")
    return lines


def _quality(scen: dict[str, Any], table: dict[str, Any], eval_blocks: int) -> list[str]:
    lines = _section("Learning quality with equal samples (like the paper's Table 3)",
                     "Every method trains the same number of steps on the same blocks (same seed, batch, ranks: iid "
                     "partition by data-parallel rank). Train ppl: last logging window, mean over ranks; eval ppl: "
                     f"{eval_blocks} held-out blocks at the end; time: training time (the sum of window times).",
                     "method | effective batch (sequences / tokens per optimizer step) | samples seen | train ppl | "
                     "eval ppl | time s")
    for key, r in table.items():
        samples = r["steps"] * scen["batch_size"] * (r["F"] * r["R"] * r["S"])
        lines.append(f"| {_label(key, r)} | {r['effective_batch']} / {r['effective_batch_tokens']} | {samples} | "
                     f"{_fmt(r['final']['train_ppl'], '.1f')} | {_fmt(r['final']['eval_ppl'], '.1f')} | "
                     f"{r['final']['train_time_s']:.1f} |")
    return lines


def _planner(scen: dict[str, Any]) -> list[str]:
    runs, pl = scen["runs"], scen["planner"]
    order = pl["predicted_order"]
    measured_order = sorted((k for k in runs if runs[k]["sync"] and k not in VARIANT_RUNS),
                            key=lambda k: runs[k]["step_s"])
    lines = ["", f"### Planner agreement (`plan` on `{_rel(scen['cluster_file'])}`, the same model, tokens and "
             f"vocabulary, fl_margin {pl['fl_margin']:.0%})", "",
             f"- predicted order of the methods' layouts (FL counted {pl['fl_margin']:.0%} slower): "
             f"{' < '.join(LABELS[k] for k in order)}",
             f"- measured order: {' < '.join(LABELS[k] for k in measured_order)}"]
    fc = pl["first_choice"]
    if fc:
        line = (f"- planner's first choice over all layouts: {fc['method']} F={fc['F']} R={fc['R']} "
                f"S={fc['S']} A={fc['A']}, {fc['predicted_step_s']:.3f} s/step predicted")
        if "planner_choice_run" in scen:
            line += f", {scen['planner_choice_run']['step_s']:.3f} s/step measured"
        lines.append(line)
    agree = scen.get("agreement")
    if agree:
        lines.append(f"- {agree['text']}: {'agree' if agree['ok'] else 'disagree'}")
        mo = agree["methods_only"]
        if agree.get("global") and mo["planner"]:
            lines.append(f"- among the methods' layouts only: planner {LABELS[mo['planner']]}, measured fastest "
                         f"{LABELS[mo['measured_fastest']]}: {'agree' if mo['ok'] else 'disagree'}")
    return lines


def render_unequal(scen: dict[str, Any]) -> list[str]:
    """Markdown sections of the unequal scenario: bytes and time of the syncs, the groups' timings, quality."""
    runs = scen["runs"]
    slow = scen.get("slow")
    lines = ["", f"## Scenario `unequal`: {scen['description']}", "",
             f"Cluster file `{_rel(scen['cluster_file'])}`; {scen['batch_size']} x {scen['seq_len']} tokens per rank "
             f"per step, {scen['steps']} steps per run, A = {scen['A']}. The equal federation has the unequal one's "
             f"model, F and ranks (F groups of their mean S)."
             + (f" Slow runs: group {slow['group']} sleeps {slow['seconds']:.3f} s after each optimizer step "
                f"({slow['why']})." if slow else ""),
             *_section("Cross-group bytes and time per sync", "Bytes every sync sends across groups (traffic meter, "
                       "summed over ranks) against the equal federation and the cost model (`perf.unequal_sync_cost`); "
                       "sync time: the ranks' mean sync window, least and most over ranks (the most includes waiting "
                       "for the last rank to arrive), and the model's.", "run | layout | s/step | MB per sync | "
                       "vs equal | model MB | vs model | per group MB | busiest rank MB (model) | sync s (ranks) | "
                       "model sync s")]
    for key, r in runs.items():
        cg, pred = r.get("cross_group") or {}, r.get("predicted_sync") or {}
        lines.append(f"| {UNEQUAL_LABELS.get(key, key)} | {r['layout']} | {r['step_s']:.3f} | "
                     f"{_mb(cg.get('bytes_per_sync'), '.3f')} | {_fmt(bytes_ratio(r, runs.get('equal')), '.3f')}x | "
                     f"{_mb(pred.get('bytes_per_sync'), '.3f')} | {_fmt(model_error(r), '+.2%')} | "
                     f"{' / '.join(f'{b / 1e6:.2f}' for b in cg.get('group_bytes_per_sync') or [])} | "
                     f"{_mb(cg.get('max_rank_bytes'), '.2f')} ({_mb(pred.get('max_rank_bytes'), '.2f')}) | "
                     f"{_fmt(cg.get('sync_s_min'), '.3f')}-{_fmt(cg.get('sync_s'), '.3f')} | "
                     f"{_fmt(pred.get('sync_s'), '.3f')} |")
    timed = {k: r for k, r in runs.items() if r.get("group_timing")}
    if timed:
        lines += _section("The groups' timings per sync (rank 0's `sync_groups` records, the first sync left out)",
                          "", "run | group | local steps | step time s | idle s | sync s | period s | idle / period")
        for key, r in timed.items():
            t = r["group_timing"]
            for g, row in enumerate(t["groups"]):
                share = t["fastest_idle_fraction"] if g == t["fastest"] else row["idle_s"] / row["period_s"] \
                    if row["period_s"] else None
                lines.append(f"| {UNEQUAL_LABELS.get(key, key)} | {g}{' (fastest)' if g == t['fastest'] else ''} | "
                             f"{row['steps']:.1f} | {row['step_time_s']:.3f} | {row['idle_s']:.3f} | "
                             f"{row['sync_s']:.3f} | {row['period_s']:.3f} | {_fmt(share, '.1%')} |")
    lines += _section("Eval perplexity", "",
                      "run | tokens seen | eval ppl (last) | at equal tokens: tokens | ppl | equal-speed ppl | delta")
    for key, r in runs.items():
        cmp = r.get("ppl_vs_equal_speed") or {}
        curve = r.get("eval_tokens") or []
        lines.append(f"| {UNEQUAL_LABELS.get(key, key)} | {_fmt(curve[-1][0] if curve else None, '.0f')} | "
                     f"{_fmt(r['final']['eval_ppl'], '.1f')} | {_fmt(cmp.get('tokens'), '.0f')} | "
                     f"{_fmt(cmp.get('eval_ppl'), '.1f')} | {_fmt(cmp.get('ref_eval_ppl'), '.1f')} | "
                     f"{_fmt(cmp.get('delta'), '+.2%')} |")
    return lines
