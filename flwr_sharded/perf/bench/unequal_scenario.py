"""The benchmark's unequal scenario: a federation of groups that shard differently (`--group-shards`) next to an
equal federation of the same model, F and ranks, and the unequal one with a group slowed down, with equal local
steps per sync and with `--group-steps speed`; what each run's probes and metrics say (docs/benchmarking.md)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from flwr_sharded.errors import ConfigError
from flwr_sharded.perf.bench.runs import BenchLayout, SyncVariant, run_training
from flwr_sharded.perf.netemu.network import EmuTopology, Fabric, load_topology, topology_dict
from flwr_sharded.perf.traffic_report import load_probes, ring_bytes_sent, sending_records

UNEQUAL_RUNS = ("equal", "unequal", "unequal-slow", "unequal-slow-speed")
"""The equal federation (as many groups of their mean S), the unequal one, and the unequal one with a slow group,
with equal local steps per sync (`--group-steps equal`) and with `--group-steps speed`."""
UNEQUAL_LABELS = {"equal": "equal federation", "unequal": "unequal federation",
                  "unequal-slow": "unequal, slow group, equal A",
                  "unequal-slow-speed": "unequal, slow group, --group-steps speed"}
SLOW_FLAG, GROUP_STEPS_FLAG = "--debug-slow-group", "--group-steps"
"""The trainer's flags of the slow runs: a group sleeping after each optimizer step, each group's local steps."""


def parse_group_shards(text: str) -> tuple[int, ...]:
    """`--unequal-groups` 2,4: at least two S >= 1, not all equal, whose sum F divides (the equal federation's
    groups have their mean S); ConfigError naming the option otherwise."""
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
    """`perf.unequal_sync_cost.unequal_sync` for the run's groups: cross-group bytes per sync (summed over ranks and
    per group) and the sync's seconds with one flow of `bandwidth_bps` per channel (None: no time)."""
    from flwr_sharded.perf.unequal_sync_cost import unequal_sync

    sync = unequal_sync([(R, S) for S in shards_per_group], shapes, wire_ratio=wire_ratio, B_F=bandwidth_bps or 1.0,
                        B_R=[bandwidth_bps or 1.0] * len(shards_per_group))
    return {"bytes_per_sync": sum(sync.group_bytes), "group_bytes_per_sync": list(sync.group_bytes),
            "max_rank_bytes": sync.max_rank_bytes, "sync_s": sync.time if bandwidth_bps else None}


def sync_group_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `sync_groups` records (rank 0's, per sync and group) of a run's metrics, in step order."""
    return sorted((r for r in records if r.get("kind") == "sync_groups"), key=lambda r: r["step"])


def group_timing(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per group over the syncs of a run's metrics (the first left out when there are more): mean step time, local
    steps, idle and sync seconds per sync; the fastest group and its idle time per sync over its sync period (its
    local steps' time + its sync's wall time, which holds the idle time). None without `sync_groups` records."""
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
    """(tokens the groups trained, eval ppl) of every eval record of a run's metrics: the groups' steps of each sync
    up to the eval's step times `group_step_tokens` (each group's tokens per step), or without a sync at that step
    its `tokens_seen` (right while the groups take equal steps)."""
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
    from flwr_sharded.parallel.wire import sync_wire_ratio

    run_dir = Path(run["run_dir"])
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    run["cross_group"] = cross_group_traffic(load_probes(run_dir / "traffic"), layout.group_ranks())
    run["predicted_sync"] = predicted_sync(layout.shards_per_group, layout.R, shapes, bandwidth_bps=bps,
                                           wire_ratio=sync_wire_ratio(variant.dtype, variant.topk, layout.F))
    run["group_shards"] = list(layout.shards_per_group)
    run["sync_groups"] = sync_group_records(records)
    run["group_timing"] = group_timing(run["sync_groups"])
    run["eval_tokens"] = eval_tokens(records, [run["batch_size"] * run["seq_len"] * layout.R * S
                                               for S in layout.shards_per_group])


def slow_seconds(run: dict[str, Any], group: int) -> tuple[float, str]:
    """The sleep after each step that makes `group` about half as fast as in `run` (its mean step time there, else
    the run's median step time), and where it came from."""
    timing = run.get("group_timing")
    if timing:
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
        def train(key: str, layout: BenchLayout, extra: list[str], eval_every: int | None = None) -> None:
            print(f"-- {UNEQUAL_LABELS[key]} {layout.text()} A={A} {' '.join(extra)} ...")
            run_opts = argparse.Namespace(**{**vars(opts), "eval_every": eval_every or opts.eval_every})
            # a training window never spans an evaluation (the trainer's windows restart after one)
            run = run_training(fab, layout, run_opts, A=A, steps=opts.steps, label=key,
                               log_every=min(A, eval_every or A), work=work / "unequal", variant=variant,
                               extra_args=extra)
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
                train(key, layouts["unequal"], [SLOW_FLAG, f"{opts.slow_group}:{seconds:.4f}", GROUP_STEPS_FLAG,
                                                "speed" if key.endswith("speed") else "equal"])
    ref = result["runs"].get("unequal")
    for key in UNEQUAL_RUNS[2:]:
        if key in result["runs"] and ref:
            run = result["runs"][key]
            run["ppl_vs_equal_speed"] = at_equal_tokens(run["eval_tokens"], ref["eval_tokens"])
    return result
