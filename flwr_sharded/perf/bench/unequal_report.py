"""An unequal federation's runs against their targets: cross-group bytes per sync from the traffic meter against the
equal federation's and `perf.unequal_sync_cost`'s, each sync's per-group timings (`sync_groups` records of metrics.jsonl: the
fastest group's idle time per sync), and eval perplexity at equal tokens against the equal-speed federation."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from flwr_sharded.perf.bench.common import REPO
from flwr_sharded.perf.traffic_report import ring_bytes_sent, sending_records

UNEQUAL_RUNS = ("equal", "unequal", "unequal-slow", "unequal-slow-speed")
"""The runs of the unequal scenario: the equal federation (as many groups of their mean S), the unequal one, and the
unequal one with a slow group, with equal local steps per sync (`--group-steps equal`) and with `--group-steps
speed`."""
UNEQUAL_LABELS = {"equal": "equal federation", "unequal": "unequal federation",
                  "unequal-slow": "unequal, slow group, equal A",
                  "unequal-slow-speed": "unequal, slow group, --group-steps speed"}
BYTES_TARGET = 1.10
"""The most cross-group bytes per sync of the unequal federation, as a multiple of the equal federation's."""
MODEL_TARGET = 0.05
"""The largest relative difference of the measured cross-group bytes per sync from `perf.unequal_sync_cost`'s."""
IDLE_TARGET = 0.10
"""The most idle time of the fastest group per sync, as a fraction of its sync period, with `--group-steps speed`."""
PPL_TARGET = 0.02
"""The largest relative difference of eval perplexity at equal tokens from the equal-speed federation's."""


# ---------------------------------------------------------------------------------------------------------------------
# Bytes and seconds of the syncs, from the traffic probes.


def cross_group_traffic(probes: list[dict[str, Any]], groups: Sequence[Sequence[int]],
                        backend: str = "gloo") -> dict[str, Any]:
    """Bytes the syncs sent across FL groups (summed over ranks; per sync and per sending group) and each rank's
    seconds per sync, from the probes of a `--measure-traffic` run whose groups hold the ranks `groups`: every sync
    collective whose process group spans FL groups (the channels' all-reduces, their set-up and votes)."""
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
    """`perf.unequal_sync_cost.unequal_sync` for the run's groups: cross-group bytes per sync (summed over ranks and per
    group) and the sync's seconds with one flow of `bandwidth_bps` per channel (None: no time)."""
    from flwr_sharded.perf.unequal_sync_cost import unequal_sync

    layouts = [(R, S) for S in shards_per_group]
    sync = unequal_sync(layouts, shapes, wire_ratio=wire_ratio, B_F=bandwidth_bps or 1.0,
                        B_R=[bandwidth_bps or 1.0] * len(layouts))
    return {"bytes_per_sync": sum(sync.group_bytes), "group_bytes_per_sync": list(sync.group_bytes),
            "max_rank_bytes": sync.max_rank_bytes, "sync_s": sync.time if bandwidth_bps else None}


# ---------------------------------------------------------------------------------------------------------------------
# Each sync's per-group timings (rank 0's `sync_groups` records).


def sync_group_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `sync_groups` records of a run's metrics, in step order."""
    return sorted((r for r in records if r.get("kind") == "sync_groups"), key=lambda r: r["step"])


def group_timing(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per group over the syncs (the first left out as warm-up when there are more): mean step time, local steps,
    idle and sync seconds per sync; the fastest group (least mean step time) and its idle time per sync as a
    fraction of its sync period (its local steps' time + its sync's wall time, which holds the idle time: a
    group's `idle_s` is its `sync_s` less the shortest group's). `records`: a run's metrics (the `sync_groups`
    ones are used). None without any."""
    records = sync_group_records(records)
    if not records:
        return None
    steady = records[1:] or records
    F = len(steady[0]["step_time_s"])

    def mean(key: str, g: int) -> float:
        return statistics.fmean(float(r[key][g]) for r in steady)

    groups = [{"step_time_s": mean("step_time_s", g), "steps": mean("steps", g), "idle_s": mean("idle_s", g),
               "sync_s": mean("sync_s", g)} for g in range(F)]
    for g in groups:
        g["period_s"] = g["steps"] * g["step_time_s"] + g["sync_s"]
    fastest = min(range(F), key=lambda g: groups[g]["step_time_s"])
    fractions = [float(r["idle_s"][fastest]) / period for r in steady
                 if (period := float(r["steps"][fastest]) * float(r["step_time_s"][fastest])
                     + float(r["sync_s"][fastest])) > 0]
    return {"groups": groups, "fastest": fastest, "syncs_used": len(steady), "syncs": len(records),
            "fastest_idle_fraction": statistics.fmean(fractions) if fractions else None,
            "fastest_idle_fraction_max": max(fractions, default=None)}


# ---------------------------------------------------------------------------------------------------------------------
# Eval perplexity at equal tokens.


def eval_tokens(records: list[dict[str, Any]], group_step_tokens: Sequence[float]) -> list[tuple[float, float]]:
    """(tokens the groups trained, eval ppl) of every eval record of a run's metrics.

    The groups' steps per sync (`sync_groups` records) times `group_step_tokens` (tokens one optimizer step of each
    group trains), summed up to the sync at the eval's step (rank 0's step count, at which it logs both); an eval
    without a sync at its step counts its `tokens_seen` (the world's tokens per step x the step: right while the
    groups take equal steps)."""
    trained, total = {}, 0.0
    for r in sync_group_records(records):
        total += sum(n * t for n, t in zip(r["steps"], group_step_tokens))
        trained[r["step"]] = total
    out = []
    for r in records:
        if r.get("kind") == "eval":
            tokens = trained.get(r["step"], r.get("tokens_seen"))
            if tokens is not None:
                out.append((float(tokens), float(r["eval_ppl"])))
    return sorted(out)


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
    if mine is None or theirs is None:
        return {"tokens": tokens, "eval_ppl": mine, "ref_eval_ppl": theirs, "delta": None}
    return {"tokens": tokens, "eval_ppl": mine, "ref_eval_ppl": theirs, "delta": mine / theirs - 1}


# ---------------------------------------------------------------------------------------------------------------------
# The targets and the report.


def unequal_checks(scen: dict[str, Any]) -> list[dict[str, Any]]:
    """The unequal scenario's targets, each with its measured value and whether it holds (None: not measured)."""
    runs, out = scen["runs"], []

    def add(name: str, value: float | None, kind: str, target: str, ok: bool | None) -> None:
        out.append({"check": f"unequal: {name}", "value": value, "kind": kind, "target": target, "ok": ok})

    ratio = bytes_ratio(runs.get("unequal"), runs.get("equal"))
    if ratio is not None:
        add("cross-group bytes per sync over the equal federation's", ratio, "ratio", f"<= {BYTES_TARGET:g}x",
            ratio <= BYTES_TARGET)
    for key in ("equal", "unequal"):
        err = model_error(runs.get(key))
        if err is not None:
            add(f"{UNEQUAL_LABELS[key]}: cross-group bytes per sync against perf.unequal_sync_cost", err, "delta",
                f"within +-{MODEL_TARGET:.0%}", abs(err) <= MODEL_TARGET)
    for key in ("unequal-slow", "unequal-slow-speed"):
        timing = (runs.get(key) or {}).get("group_timing")
        if timing and timing["fastest_idle_fraction"] is not None:
            v = timing["fastest_idle_fraction"]
            add(f"{UNEQUAL_LABELS[key]}: fastest group's idle time per sync over its sync period", v, "share",
                f"<= {IDLE_TARGET:.0%}" if key.endswith("speed") else "(today's, for reference)",
                v <= IDLE_TARGET if key.endswith("speed") else None)
        cmp = (runs.get(key) or {}).get("ppl_vs_equal_speed")
        if cmp and key.endswith("speed"):
            v = cmp["delta"]
            add(f"{UNEQUAL_LABELS[key]}: eval ppl at equal tokens against the equal-speed federation", v, "delta",
                f"within +-{PPL_TARGET:.0%}", v is not None and abs(v) <= PPL_TARGET)
    return out


def bytes_ratio(run: dict[str, Any] | None, ref: dict[str, Any] | None) -> float | None:
    """A run's cross-group bytes per sync over the reference's."""
    mine = ((run or {}).get("cross_group") or {}).get("bytes_per_sync")
    theirs = ((ref or {}).get("cross_group") or {}).get("bytes_per_sync")
    return mine / theirs if mine is not None and theirs else None


def model_error(run: dict[str, Any] | None) -> float | None:
    """(measured - predicted) / predicted cross-group bytes per sync of a run."""
    mine = ((run or {}).get("cross_group") or {}).get("bytes_per_sync")
    pred = ((run or {}).get("predicted_sync") or {}).get("bytes_per_sync")
    return mine / pred - 1 if mine is not None and pred else None


def _rel(path: str) -> str:
    try:
        return str(Path(path).relative_to(REPO))
    except ValueError:
        return path


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def render_unequal(scen: dict[str, Any]) -> list[str]:
    """Markdown sections of the unequal scenario: bytes and time of the syncs, the groups' timings, quality."""
    runs = scen["runs"]
    slow = scen.get("slow")
    lines = ["", f"## Scenario `unequal`: {scen['description']}", "",
             f"Cluster file `{_rel(scen['cluster_file'])}`; {scen['batch_size']} x {scen['seq_len']} tokens per rank per "
             f"step, {scen['steps']} steps per run, A = {scen['A']}. The equal federation has the unequal one's "
             f"model, F and ranks (F groups of their mean S)."
             + (f" Slow runs: group {slow['group']} sleeps {slow['seconds']:.3f} s after each optimizer step "
                f"({slow['why']})." if slow else ""),
             "", "### Cross-group bytes and time per sync",
             "Bytes every sync sends across groups (traffic meter, summed over ranks) against the equal federation "
             "and the cost model (`perf.unequal_sync_cost`); sync time: the ranks' mean sync window, least and most over ranks "
             "(the most includes waiting for the last rank to arrive), and the model's.",
             "", "| run | layout | s/step | MB per sync | vs equal | model MB | vs model | per group MB | "
             "busiest rank MB (model) | sync s (ranks) | model sync s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in runs.items():
        cg, pred = r.get("cross_group") or {}, r.get("predicted_sync") or {}
        mb = cg.get("bytes_per_sync")
        lines.append(f"| {UNEQUAL_LABELS.get(key, key)} | {r['layout']} | {r['step_s']:.3f} | "
                     f"{_f(mb and mb / 1e6, '.3f')} | {_f(bytes_ratio(r, runs.get('equal')), '.3f')}x | "
                     f"{_f(pred.get('bytes_per_sync') and pred['bytes_per_sync'] / 1e6, '.3f')} | "
                     f"{_f(model_error(r), '+.2%')} | "
                     f"{' / '.join(f'{b / 1e6:.2f}' for b in cg.get('group_bytes_per_sync') or [])} | "
                     f"{_f(cg.get('max_rank_bytes') and cg['max_rank_bytes'] / 1e6, '.2f')} "
                     f"({_f(pred.get('max_rank_bytes') and pred['max_rank_bytes'] / 1e6, '.2f')}) | "
                     f"{_f(cg.get('sync_s_min'), '.3f')}-{_f(cg.get('sync_s'), '.3f')} | "
                     f"{_f(pred.get('sync_s'), '.3f')} |")
    timed = {k: r for k, r in runs.items() if r.get("group_timing")}
    if timed:
        lines += ["", "### The groups' timings per sync (rank 0's `sync_groups` records, the first sync left out)", "",
                  "| run | group | local steps | step time s | idle s | sync s | period s | idle / period |",
                  "|---|---|---|---|---|---|---|---|"]
        for key, r in timed.items():
            t = r["group_timing"]
            for g, row in enumerate(t["groups"]):
                share = t["fastest_idle_fraction"] if g == t["fastest"] else row["idle_s"] / row["period_s"] \
                    if row["period_s"] else None
                lines.append(f"| {UNEQUAL_LABELS.get(key, key)} | {g}{' (fastest)' if g == t['fastest'] else ''} | "
                             f"{row['steps']:.1f} | {row['step_time_s']:.3f} | {row['idle_s']:.3f} | "
                             f"{row['sync_s']:.3f} | {row['period_s']:.3f} | {_f(share, '.1%')} |")
    lines += ["", "### Eval perplexity", "",
              "| run | tokens seen | eval ppl (last) | at equal tokens: tokens | ppl | equal-speed ppl | delta |",
              "|---|---|---|---|---|---|---|"]
    for key, r in runs.items():
        cmp = r.get("ppl_vs_equal_speed") or {}
        curve = r.get("eval_tokens") or []
        lines.append(f"| {UNEQUAL_LABELS.get(key, key)} | {_f(curve[-1][0] if curve else None, '.0f')} | "
                     f"{_f(r['final']['eval_ppl'], '.1f')} | {_f(cmp.get('tokens'), '.0f')} | "
                     f"{_f(cmp.get('eval_ppl'), '.1f')} | {_f(cmp.get('ref_eval_ppl'), '.1f')} | "
                     f"{_f(cmp.get('delta'), '+.2%')} |")
    return lines
