"""The unequal scenario of the benchmark: a federation of groups that shard differently (`--group-shards`) next to an
equal federation of the same model, F and ranks, and the unequal one with a group slowed down, with equal local
steps per sync and with `--group-steps speed`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flwr_sharded.errors import ConfigError
from flwr_sharded.perf.bench.common import _say
from flwr_sharded.perf.bench.layouts import BenchLayout, SyncVariant
from flwr_sharded.perf.bench.training_run import run_training
from flwr_sharded.perf.bench.unequal_report import (UNEQUAL_LABELS, UNEQUAL_RUNS, at_equal_tokens,
                                                    cross_group_traffic, eval_tokens, group_timing, predicted_sync,
                                                    sync_group_records)
from flwr_sharded.perf.netemu.network import Fabric
from flwr_sharded.perf.netemu.topology import EmuTopology, load_topology, topology_dict
from flwr_sharded.perf.traffic_report import load_probes

SLOW_FLAG, GROUP_STEPS_FLAG = "--debug-slow-group", "--group-steps"
"""The trainer's flags the slow runs need: a group sleeping after each optimizer step, and each group's local steps
per sync from its measured step time."""


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
    return {"equal": BenchLayout("fl-fsdp", F, 1, sum(shards) // F), "unequal": BenchLayout.unequal("fl-fsdp", 1, shards)}


def param_shapes(model: str, vocab: int, seq_len: int) -> list[tuple[int, ...]]:
    """Global shapes of the parameters the engine builds (what the sync plan cuts)."""
    from flwr_sharded.training.models import build_model

    return [tuple(p.shape) for p in build_model(model, vocab_size=vocab, max_seq_len=seq_len).parameters()]


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
    step_tokens = [run["batch_size"] * run["seq_len"] * layout.R * S for S in layout.shards_per_group]
    run["eval_tokens"] = eval_tokens(records, step_tokens)


def slow_seconds(run: dict[str, Any], group: int) -> tuple[float, str]:
    """The sleep after each step that makes `group` about half as fast as in `run`: its mean step time there (from
    the `sync_groups` records), else the run's median step time; and where it came from."""
    timing = run.get("group_timing")
    if timing:
        return timing["groups"][group]["step_time_s"], f"group {group}'s mean step time in the unequal run"
    return run["step_s"], "the unequal run's median step time"


def unequal_scenario(cluster_path: Path, opts: argparse.Namespace, work: Path, vocab: int) -> dict[str, Any]:
    """Train the scenario's runs one after the other on the cluster of `--unequal`; results as `_scenario`'s."""
    topo = load_topology(cluster_path)
    shards = parse_group_shards(opts.unequal_groups)
    layouts = unequal_layouts(shards, topo, opts.slow_group)
    A = opts.aggregate_every
    opts = argparse.Namespace(**{**vars(opts), "eval_every": min(opts.eval_every, A)})
    bps = topo.inter_group_bps if topo.groups > 1 else topo.inter_node_bps
    shapes = param_shapes(opts.model, vocab, opts.seq_len)
    variant = SyncVariant(dtype=opts.sync_dtype)
    result: dict[str, Any] = {"name": "unequal", "cluster_file": str(cluster_path), "topology": topology_dict(topo),
                              "description": topo.describe(), "notes": list(topo.notes), "steps": opts.steps,
                              "repeats": 1, "batch_size": opts.batch_size, "seq_len": opts.seq_len, "A": A,
                              "sync_bps": bps, "runs": {}}
    _say(f"\n== scenario unequal: {topo.describe()}; groups {layouts['equal'].text()} and "
         f"{layouts['unequal'].text()}; {opts.steps} steps per run")
    with Fabric(topo) as fab:
        def train(key: str, layout: BenchLayout, extra: list[str], eval_every: int | None = None) -> None:
            _say(f"-- {UNEQUAL_LABELS[key]} {layout.text()} A={A} {' '.join(extra)} ...")
            run_opts = argparse.Namespace(**{**vars(opts), "eval_every": eval_every or opts.eval_every})
            # a training window never spans an evaluation (the trainer's windows restart after one)
            run = run_training(fab, layout, run_opts, A=A, steps=opts.steps, label=key,
                               log_every=min(A, eval_every or A),
                               work=work / "unequal", variant=variant, extra_args=extra)
            run.update(batch_size=opts.batch_size, seq_len=opts.seq_len)
            _inspect(run, layout, shapes, bps, variant)
            result["runs"][key] = run
            cg = run["cross_group"]
            _say(f"   {run['step_s']:.3f} s/step, wall {run['wall_s']:.0f} s, "
                 f"{(cg['bytes_per_sync'] or 0) / 1e6:.3f} MB across groups per sync "
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
            slow = [SLOW_FLAG, f"{opts.slow_group}:{seconds:.4f}"]
            for key in slow_keys:
                train(key, layouts["unequal"], [*slow, GROUP_STEPS_FLAG, "speed" if key.endswith("speed") else "equal"])
    ref = result["runs"].get("unequal")
    for key in UNEQUAL_RUNS[2:]:
        if key in result["runs"] and ref:
            run = result["runs"][key]
            run["ppl_vs_equal_speed"] = at_equal_tokens(run["eval_tokens"], ref["eval_tokens"])
    return result
