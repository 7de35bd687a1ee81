"""The bench's targets: each measured against what it must reach (`checks`, one row each: the value, its kind, the
target, whether it holds), the time-to-target summary they read, and the planner's agreement with the measured
runs."""

from __future__ import annotations

from typing import Any

from flwr_sharded_perf.bench.convergence import compute_utilisation, time_to_target
from flwr_sharded_perf.bench.runs import LABELS, UNEQUAL_LABELS, VARIANT_RUNS, WIRE_BYTES_TARGETS, variant_wire

BYTES_TARGET = 1.10
"""The most cross-group bytes per sync of the unequal federation, as a multiple of the equal federation's."""

MODEL_TARGET = 0.05
"""The largest relative difference of the measured cross-group bytes per sync from `perf.unequal_sync_cost`'s."""

IDLE_TARGET = 0.10
"""The most idle time of the fastest group per sync, as a fraction of its sync period, with `--group-steps speed`."""

PPL_TARGET = 0.02
"""The largest relative difference of eval perplexity at equal tokens from the equal-speed federation's."""

TIME_TARGET = 0.5
"""The most training time the best sync variant may take to reach the blocking sync's final eval perplexity, as a
fraction of the blocking run's time to it."""

UTILISATION_TARGET = 0.95
"""The least compute utilisation of that variant (`compute_utilisation`)."""

TTT_RUNS = ("fl-fsdp", "no-sync", *VARIANT_RUNS)
"""The runs of the time-to-target table: the FL+FSDP layout's, blocking (the reference), without syncs, and the
variants."""


def _check(name: str, value: float | None, kind: str, target: str, ok: bool | None) -> dict[str, Any]:
    return {"check": name, "value": value, "kind": kind, "target": target, "ok": ok}


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, each with its measured value and whether it holds (None: not measured)."""
    runs, out = results["scenarios"].get("main", {"runs": {}})["runs"], []
    if "fsdp" in runs and "fl-fsdp" in runs:
        v = runs["fsdp"]["step_s"] / runs["fl-fsdp"]["step_s"]
        out.append(_check("FL+FSDP speedup over FSDP (median step time)", v, "ratio", ">= 5x", v >= 5))
    if "hsdp" in runs and "fl-hsdp" in runs:
        v = runs["hsdp"]["step_s"] / runs["fl-hsdp"]["step_s"]
        out.append(_check("FL+HSDP speedup over HSDP (median step time)", v, "ratio", "> 1x", v > 1))
    if "no-sync" in runs and "fl-fsdp" in runs:
        a = runs["fl-fsdp"]
        v = a["step_s_mean"] / runs["no-sync"]["step_s_mean"] - 1
        out.append(_check("FL+FSDP above its no-sync limit (mean step time)", v, "delta", "<= +20%", v <= 0.20))
        v = a["sync_s_mean"] / (a["step_s_mean"] - a["sync_s_mean"])
        out.append(_check("(same, within the FL+FSDP run: sync time over the other phases)", v, "delta", "<= +20%",
                          v <= 0.20))
    out += sync_variant_checks(runs)
    out += time_to_target_checks(time_to_target_summary(runs))
    if "unequal" in results["scenarios"]:
        out += unequal_checks(results["scenarios"]["unequal"])
    for name, scen in results["scenarios"].items():
        if name == "unequal":
            continue
        errors = [r["traffic_max_error"] for r in [*scen["runs"].values(), *scen.get("sweep", [])]
                  if "traffic_max_error" in r]
        if "planner_choice_run" in scen:
            errors.append(scen["planner_choice_run"].get("traffic_max_error", 0.0))
        if errors:
            out.append(_check(f"{name}: collectives vs predicted bytes per tier, worst run and tier", max(errors),
                              "share", "<= 5%", max(errors) <= 0.05))
        agree = scen.get("agreement")
        if agree:
            out.append(_check(f"{name}: planner's first choice = measured fastest" if agree.get("global") else
                              f"{name}: planner's choice among the measured methods = measured fastest", None, "text",
                              agree["text"], agree["ok"]))
    return out


def cross_group_bytes_per_sync(run: dict[str, Any]) -> float | None:
    """Bytes the run's syncs sent across groups, per whole-model sync (collectives, summed over ranks)."""
    t = run.get("traffic")
    return t["collectives"]["sync"]["inter_group"] / t["syncs"] if t and t.get("syncs") else None


def fp32_like(runs: dict[str, Any], run: dict[str, Any]) -> str | None:
    """The blocking fp32 FL+FSDP run that syncs over the same ring as `run` (the flat one, or two levels over the
    same sites), to compare its bytes with: `fl-fsdp`, else `fl-fsdp-flat`; None if neither did."""
    for key in ("fl-fsdp", "fl-fsdp-flat"):
        ref = runs.get(key)
        if (ref and (ref.get("sync_variant") or {}).get("dtype", "float32") == "float32"
                and ref.get("sync_sites") == run.get("sync_sites")):
            return key
    return None


def sync_variant_checks(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """The overlapped, quantized and sparse syncs against the FL+FSDP run's sync, FSDP and the no-sync limit; each
    wire's bytes against the fp32 sync's over the same ring (`fp32_like`)."""
    out = []
    for key in (k for k in VARIANT_RUNS if "overlap" in k and k in runs):
        if "no-sync" in runs:
            v = runs[key]["step_s_mean"] / runs["no-sync"]["step_s_mean"] - 1
            out.append(_check(f"{LABELS[key]} above the no-sync limit (mean step time)", v, "delta", "<= +5%",
                              v <= 0.05))
        if "fsdp" in runs:
            v = runs["fsdp"]["step_s"] / runs[key]["step_s"]
            out.append(_check(f"{LABELS[key]} speedup over FSDP (median step time)", v, "ratio", ">= 8x", v >= 8))
    for key in VARIANT_RUNS:
        target = WIRE_BYTES_TARGETS.get(variant_wire(key) or "")
        if key not in runs or not target:
            continue
        ring, like = "flat ring" if runs[key].get("sync_sites") is None else "two-level", fp32_like(runs, runs[key])
        what = f"{LABELS[key]}: cross-group bytes per sync over the fp32 sync's ({ring})"
        mine, theirs = cross_group_bytes_per_sync(runs[key]), cross_group_bytes_per_sync(runs[like]) if like else None
        if like is None:
            out.append(_check(f"{what}: no blocking fp32 run over the same ring to compare with", None, "ratio",
                              f"<= {target:g}x", None))
        elif mine is not None and theirs:
            out.append(_check(what, mine / theirs, "ratio", f"<= {target:g}x", mine / theirs <= target))
    reference = runs.get("fl-fsdp")
    base = (reference or {}).get("final", {}).get("eval_ppl")
    for key in VARIANT_RUNS:
        ppl = runs.get(key, {}).get("final", {}).get("eval_ppl")
        if key in runs and base and ppl and runs[key].get("steps") == reference.get("steps"):  # the same samples
            out.append(_check(f"{LABELS[key]}: eval perplexity against the blocking "
                              f"{reference['sync_variant']['dtype']} sync (same samples)", ppl / base - 1, "delta",
                              "within +-2%", abs(ppl / base - 1) <= 0.02))
    return out


def time_to_target_summary(runs: dict[str, Any]) -> dict[str, Any] | None:
    """Against the blocking FL+FSDP run's final eval ppl (the target), per run of `TTT_RUNS` with an eval curve: its
    final eval ppl, its time to the target (`time_to_target`) and that over the blocking run's own, its compute
    utilisation (`compute_utilisation`) and cross-group bytes per sync over the blocking run's. Times come from each
    run's first repeat, step times from all repeats. None without the blocking run's eval curve."""
    ref = runs.get("fl-fsdp")
    target = ((ref or {}).get("final") or {}).get("eval_ppl")
    if not ref or not ref.get("eval") or not target:
        return None
    ref_time, ref_bytes, no_sync = time_to_target(ref["eval"], target), cross_group_bytes_per_sync(ref), \
        runs.get("no-sync")
    rows = {}
    for key in (k for k in TTT_RUNS if runs.get(k, {}).get("eval")):
        r = runs[key]
        t, sent = time_to_target(r["eval"], target), cross_group_bytes_per_sync(r)
        rows[key] = {"final_eval_ppl": r["final"]["eval_ppl"], "time_to_target_s": t,
                     "vs_reference": t / ref_time if t is not None and ref_time else None,
                     "train_time_s": r["final"]["train_time_s"], "eval_points": len(r["eval"]),
                     "compute_utilisation": compute_utilisation(r, no_sync) if no_sync else None,
                     "cross_group_bytes_per_sync": sent,
                     "bytes_vs_reference": 0.0 if not r["sync"] else sent / ref_bytes if sent is not None and
                     ref_bytes else None}
    return {"reference": "fl-fsdp", "reference_dtype": (ref.get("sync_variant") or {}).get("dtype", "float32"),
            "target_eval_ppl": target, "reference_time_s": ref_time,
            "time": "training wall time (steps and the syncs they wait for, not evaluation) to the first eval at or "
                    "below the target, linear in log perplexity between the eval points around it",
            "utilisation": "the no-sync run's mean step time over the run's", "runs": rows}


def dtype_label(dtype: str) -> str:
    """A wire dtype's short name in the checks and tables (fp32, bf16; the others as named)."""
    return {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)


def time_to_target_checks(summary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The best sync variant reaches the blocking sync's final eval ppl in at most `TIME_TARGET` of that run's time,
    with compute utilisation >= `UTILISATION_TARGET`. The best: the fastest to it of the variants meeting both, else
    the fastest to it; no rows without variants."""
    variants = {k: r for k, r in (summary or {}).get("runs", {}).items() if k in VARIANT_RUNS}
    if not variants:
        return []
    ref = dtype_label(summary["reference_dtype"])
    what = f"time to the blocking {ref} sync's final eval ppl, over the {ref} run's time to it"
    reached = {k: r for k, r in variants.items() if r["vs_reference"] is not None}
    if not reached:
        return [_check(f"best sync variant: {what} (none of {len(variants)} reached it)", None, "ratio",
                       f"<= {TIME_TARGET:g}x", False)]

    def meets(r: dict[str, Any]) -> bool:
        u = r["compute_utilisation"]
        return r["vs_reference"] <= TIME_TARGET and u is not None and u >= UTILISATION_TARGET

    best = min([k for k, r in reached.items() if meets(r)] or reached, key=lambda k: reached[k]["vs_reference"])
    r = reached[best]
    out = [_check(f"best sync variant, {LABELS.get(best, best)}: {what}", r["vs_reference"], "ratio",
                  f"<= {TIME_TARGET:g}x", r["vs_reference"] <= TIME_TARGET)]
    u = r["compute_utilisation"]
    if u is not None:
        out.append(_check("(same run: compute utilisation, the no-sync run's mean step time over its own)", u, "share",
                          f">= {UTILISATION_TARGET:.0%}", u >= UTILISATION_TARGET))
    return out


def unequal_checks(scen: dict[str, Any]) -> list[dict[str, Any]]:
    """The unequal scenario's targets, each with its measured value and whether it holds (None: not measured)."""
    runs, out = scen["runs"], []

    def add(name: str, value: float | None, kind: str, target: str, ok: bool | None) -> None:
        out.append(_check(f"unequal: {name}", value, kind, target, ok))

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
        timing, speed = (runs.get(key) or {}).get("group_timing"), key.endswith("speed")
        if timing and timing["fastest_idle_fraction"] is not None:
            v = timing["fastest_idle_fraction"]
            add(f"{UNEQUAL_LABELS[key]}: fastest group's idle time per sync over its sync period", v, "share",
                f"<= {IDLE_TARGET:.0%}" if speed else "(today's, for reference)", v <= IDLE_TARGET if speed else None)
        cmp = (runs.get(key) or {}).get("ppl_vs_equal_speed")
        if cmp and speed:
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


def agreement(scen: dict[str, Any]) -> dict[str, Any] | None:
    """The planner's first choice and ranking against the measured fastest, and what its FL margin picks of them."""
    plan = scen.get("planner")
    measured = {k: r for k, r in scen["runs"].items() if r["sync"] and k not in VARIANT_RUNS}
    if "planner_choice_run" in scen:
        measured["planner-choice"] = scen["planner_choice_run"]
    if not plan or not measured:
        return None
    margin, first = plan["fl_margin"], plan["first_choice"]
    keys = ("method", "F", "R", "S", "A")

    def name(k: str) -> str:
        return f"{measured[k]['method']} {measured[k]['layout']} A={measured[k]['A']}"

    def step(k: str) -> float:
        return measured[k]["step_s"]

    fastest = min(measured, key=step)
    choice = "planner-choice" if "planner-choice" in measured else None if first is None else next(
        (k for k, r in measured.items() if [r[x] for x in keys] == [first[x] for x in keys]), None)
    methods = [k for k in plan["predicted_order"] if k in measured]
    restricted, restricted_fastest = (methods[0], min(methods, key=step)) if methods else (None, None)
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
    by_rule = min(measured, key=lambda k: step(k) * (1 + margin if measured[k]["method"].startswith("fl-") else 1))
    if by_rule != fastest:
        text += f"; the planner's {margin:.0%} FL margin applied to the measured times picks {name(by_rule)}"
    return {**out, "planner": choice, "measured_fastest": fastest, "measured_by_rule": by_rule, "gap": gap,
            "ok": choice == fastest, "ok_by_rule": choice == by_rule, "global": True, "text": text}
