"""Server path against decentralised sync through Flower: the same groups, model and schedule in one run each.

    PATH=.venv/bin:$PATH python benchmarks/server_path_flower.py --model small --num-server-rounds 5 \
        --out benchmarks/results/...

Runs `apps/llama_fl_hsdp/run_simulation.sh` twice, alternating the order per repeat (decentralized, then server, or
the reverse), with K = 1 sync per round so both paths sync after the same A steps. Per round it takes from the
ServerApp's metrics:
  train_s   the slowest group's local training time of the round
  sync      decentralized: the slowest group's sync time (rendezvous + shard all-reduce);
            server: everything from the last train reply's arrival to the last group's adoption of the mean
            (manifest checks, pulls, fold, finalize, chunked applies, each rank's assembly and apply), plus the
            export the groups did
  round_s   the round's wall time at the ServerApp
and reports medians (round 1 is left out: it includes start-up) and the server/decentralized ratios.

Server memory is measured by `benchmarks/server_memory_flower.py` (a deployment: in a local simulation the
ServerApp's process also runs the simulation engine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from flwr_sharded import schema, tool_options
from flwr_sharded.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from flwr_sharded.flower.run_config import FederationConfig
from flwr_sharded.schema import same_as
from flwr_sharded_perf.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "apps" / "llama_fl_hsdp" / "run_simulation.sh"


@dataclass
class RunOptions:
    """The run config's options of both runs (the Flower app's own flags and docstrings)."""

    model: str = same_as(ModelConfig, "name")
    rounds: int = same_as(FederationConfig, "rounds", default=5)
    aggregate_every: int = same_as(ParallelConfig, "aggregate_every", default=2)
    seq_len: int = same_as(DataConfig, "seq_len", default=64)
    batch_size: int = same_as(TrainConfig, "batch_size", default=2)
    data_dir: str = same_as(DataConfig, "data_dir", default=str(REPO / ".data"))
    shards: int = same_as(ParallelConfig, "shards", default=2)
    server_buffer_mb: float = same_as(FederationConfig, "server_buffer_mb")


def run(aggregation: str, args: argparse.Namespace, work: Path) -> list[dict]:
    run_dir = work / aggregation
    metrics = run_dir / "metrics.jsonl"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = {"model": args.model, "seq-len": args.seq_len, "batch-size": args.batch_size, "syncs-per-round": 1,
              "aggregate-every": args.aggregate_every, "num-server-rounds": args.rounds, "eval-blocks": 8,
              "aggregation": aggregation, "run-dir": str(run_dir), "save-model": False, "evaluate-in-train": False,
              "shards": args.shards, "server-buffer-mb": args.server_buffer_mb, "data-dir": args.data_dir}
    options = []
    for key, value in config.items():
        options += ["--run-config", f"{key}={json.dumps(value) if isinstance(value, (str, bool)) else value}"]
    env = {**os.environ, "FLWR_SHARDED_GROUPS": str(args.groups), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run(["bash", str(DEMO), *options], capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    if proc.returncode != 0 or not metrics.exists():
        sys.exit(f"{aggregation} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rounds = [json.loads(line) for line in metrics.read_text().splitlines() if '"kind": "round"' in line]
    print(f"  {aggregation}: {len(rounds)} rounds in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return rounds


def sync_seconds(record: dict) -> float:
    if "server_sync_s" in record:  # server path: the facility sync over a group of one is in sync_s too
        return record["server_sync_s"] + record["sync_s"]
    return record["sync_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=schema.HelpFormatter)
    schema.add_arguments(p, RunOptions)
    p.add_argument("--groups", type=int, default=2, help="groups of the simulation (FLWR_SHARDED_GROUPS)")
    p.add_argument("--paths", default="decentralized,server", help="which paths to run (comma-separated)")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs, order alternated")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--out", default="", help="result JSON (none when empty)")
    args = tool_options.parse_args(p, RunOptions)
    paths = [a for a in ("decentralized", "server") if a in args.paths.split(",")]
    if not paths:
        sys.exit("--paths names neither decentralized nor server")
    samples: dict[str, dict[str, list[float]]] = {a: {"sync": [], "round": [], "train": []} for a in paths}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for aggregation in (paths if repeat % 2 == 0 else paths[::-1]):
                for r in run(aggregation, args, Path(tmp))[1:]:
                    samples[aggregation]["sync"].append(sync_seconds(r))
                    samples[aggregation]["round"].append(r["round_s"])
                    samples[aggregation]["train"].append(r["train_s"])
    med = {a: {k: statistics.median(v) for k, v in s.items()} for a, s in samples.items()}
    result = {"provenance": provenance(), "config": vars(args), "medians_s": med, "samples_s": samples}
    print(f"{'path':<14} {'sync s':>8} {'train s':>8} {'round s':>8}")
    for a in med:
        print(f"{a:<14} {med[a]['sync']:8.3f} {med[a]['train']:8.3f} {med[a]['round']:8.3f}")
    if len(med) == 2:
        result.update(ratio_sync=med["server"]["sync"] / med["decentralized"]["sync"],
                      ratio_round=med["server"]["round"] / med["decentralized"]["round"])
        print(f"server / decentralized: sync {result['ratio_sync']:.2f}x, round {result['ratio_round']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
