"""Groups of different speeds in a real Flower deployment on one machine: the idle time per sync with `group-steps`
equal and speed, and the held-out perplexity at equal tokens.

    PATH=.venv/bin:$PATH python benchmarks/flower_group_speeds.py --out benchmarks/results/flower_group_speeds.json

Three runs of `flwr run apps/llama_fl_hsdp` on loopback (a SuperLink, two group torchrun jobs, two SuperNodes),
decentralised path, in one invocation: (1) equal speeds; (2) group 1 sleeping after each of its steps for its own
median step time in run 1 (so about half as fast), `group-steps equal`; (3) the same with `group-steps speed`; (4)
equal speeds again, with as many rounds as give run 3's tokens (its learning-rate schedule then spans the same
tokens). From every round's record (`idle_s_per_sync`, `sync_period_s`, `step_s`, `member_steps`): the fastest
member's idle time as a share of its sync period (median over the rounds after the first, which measures in run 3),
and run 3's final eval perplexity against run 4's (equal tokens, each at the end of its schedule) and against run 1's
at the same tokens (linear in tokens between run 1's rounds, mid-schedule). Everything started is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from flwr_sharded import schema, tool_options
from flwr_sharded.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from flwr_sharded.flower.run_config import FederationConfig
from flwr_sharded.schema import same_as

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.local_flower: the loopback deployment

from tests.local_flower import Procs, deployment_rounds  # noqa: E402
from tests.multiproc import faults_env  # noqa: E402
from flwr_sharded_perf.provenance import provenance  # noqa: E402

APP = REPO / "apps" / "llama_fl_hsdp"


@dataclass
class RunOptions:
    """The run config's options of every run (the Flower app's own flags and docstrings)."""

    model: str = same_as(ModelConfig, "name", default="small")
    shards: int = same_as(ParallelConfig, "shards", default=1)
    seq_len: int = same_as(DataConfig, "seq_len", default=64)
    batch_size: int = same_as(TrainConfig, "batch_size", default=2)
    aggregate_every: int = same_as(ParallelConfig, "aggregate_every", default=8)
    syncs_per_round: int = same_as(FederationConfig, "syncs_per_round", default=1)
    rounds: int = same_as(FederationConfig, "rounds", default=12)
    data_dir: str = same_as(DataConfig, "data_dir", default=str(REPO / ".data"))


def deploy(name: str, args: argparse.Namespace, work: Path, *, group_steps: str, delay: float,
           rounds: int) -> list[dict]:
    """One run of `rounds` rounds; returns its round records (also written to `work/<name>.jsonl`)."""
    procs = Procs(work / name)
    procs.workdir.mkdir(parents=True)
    slowed = faults_env(step_delay=delay) if delay else None  # tests/faults: every rank of group 1 sleeps
    config = {"model": args.model, "shards": args.shards, "seq-len": args.seq_len, "batch-size": args.batch_size,
              "aggregate-every": args.aggregate_every, "syncs-per-round": args.syncs_per_round,
              "num-server-rounds": rounds, "eval-blocks": 64, "group-steps": group_steps, "num-groups": 2,
              "data-dir": args.data_dir, "save-model": False}
    try:
        records = deployment_rounds(procs, APP, [("group0", {"shards": args.shards}),
                                                 ("group1", {"shards": args.shards, "env": slowed})], config,
                                    timeout=args.timeout)
    except RuntimeError as exc:
        sys.exit(f"{name}: {exc}")
    finally:
        procs.close()
    (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def pace(rounds: list[dict]) -> dict:
    """The fastest member's (least step time) and the other's figures, medians over the rounds after the first in
    which both members synced."""
    later = [r for r in rounds[1:] if "step_s" in r]
    if not later:
        raise SystemExit(f"no round after the first has both members' timings: {json.dumps(rounds)[:3000]}")
    step = {n: statistics.median(r["step_s"][n] for r in later) for n in later[0]["step_s"]}
    fastest = min(step, key=step.get)
    out = {}
    for role, node in (("fastest", fastest), ("other", next(n for n in step if n != fastest))):
        idle = statistics.median(r["idle_s_per_sync"][node] for r in later)
        period = statistics.median(r["sync_period_s"][node] for r in later)
        steps = statistics.median(r.get("member_steps", {}).get(node, r["steps"] // r["syncs"]) for r in later)
        out[role] = {"node": node, "local_steps": steps, "step_s": step[node], "idle_s_per_sync": idle,
                     "sync_period_s": period, "idle_share": idle / period}
    return out


def ppl_at(rounds: list[dict], tokens: float) -> float:
    """Eval perplexity at `tokens`, linear in tokens between two rounds (exp of the interpolated loss)."""
    points = [(r["tokens_seen"], r["eval_loss"]) for r in rounds]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return math.exp(l0 + (l1 - l0) * (tokens - t0) / (t1 - t0))
    raise ValueError(f"{tokens} tokens outside {points[0][0]}..{points[-1][0]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=schema.HelpFormatter)
    schema.add_arguments(p, RunOptions)
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--out", default="", help="result JSON (none when empty)")
    p.add_argument("--work", default="", help="keep each run's processes' logs and round records here (default: a "
                   "temporary directory, removed)")
    args = tool_options.parse_args(p, RunOptions)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        started = time.monotonic()
        equal = deploy("equal-speed", args, work, group_steps="equal", delay=0.0, rounds=args.rounds)
        delay = statistics.median(r["step_s"][r["members"][1]] for r in equal[1:])  # members: by partition id
        print(f"equal speeds: {time.monotonic() - started:.0f} s; group 1 then sleeps {delay:.3f} s per step",
              flush=True)
        slowed = deploy("slowed-equal", args, work, group_steps="equal", delay=delay, rounds=args.rounds)
        speed = deploy("slowed-speed", args, work, group_steps="speed", delay=delay, rounds=args.rounds)
        per_round = equal[-1]["tokens_seen"] / args.rounds
        matched_rounds = max(2, round(speed[-1]["tokens_seen"] / per_round))
        matched = deploy("equal-speed-matched", args, work, group_steps="equal", delay=0.0, rounds=matched_rounds)
    runs = {"equal speeds": equal, "group 1 slowed, group-steps equal": slowed,
            "group 1 slowed, group-steps speed": speed, f"equal speeds, {matched_rounds} rounds": matched}
    results = {name: {"pace": pace(rounds), "tokens": rounds[-1]["tokens_seen"], "eval_ppl": rounds[-1]["eval_ppl"],
                      "rounds": rounds} for name, rounds in runs.items()}
    at = speed[-1]["tokens_seen"]
    mid_schedule = ppl_at(equal, at)
    vs = {"equal_speeds_matched_tokens": speed[-1]["eval_ppl"] / matched[-1]["eval_ppl"] - 1,
          "equal_speeds_same_tokens_mid_schedule": speed[-1]["eval_ppl"] / mid_schedule - 1}
    results["group 1 slowed, group-steps speed"]["eval_ppl_vs"] = vs
    for name, row in results.items():
        f, o = row["pace"]["fastest"], row["pace"]["other"]
        print(f"{name}: fastest node {f['node']} {f['local_steps']:g} steps/sync at {f['step_s']:.3f} s, idle "
              f"{f['idle_s_per_sync']:.2f} of {f['sync_period_s']:.2f} s per sync ({100 * f['idle_share']:.1f}%); "
              f"other {o['local_steps']:g} steps at {o['step_s']:.3f} s, idle {100 * o['idle_share']:.1f}%; "
              f"{row['tokens']} tokens, eval ppl {row['eval_ppl']:.2f}")
    print(f"speed's eval ppl {speed[-1]['eval_ppl']:.2f} at {at} tokens: "
          f"{100 * vs['equal_speeds_matched_tokens']:+.2f}% against equal speeds over {matched[-1]['tokens_seen']} "
          f"tokens ({matched[-1]['eval_ppl']:.2f}); {100 * vs['equal_speeds_same_tokens_mid_schedule']:+.2f}% "
          f"against equal speeds at {at} of its {equal[-1]['tokens_seen']} tokens ({mid_schedule:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps({"provenance": provenance(), "config": vars(args),
                                              "slow_delay_s": delay, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
