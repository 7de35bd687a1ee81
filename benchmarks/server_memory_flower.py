"""Peak memory of the ServerApp on the server path, in a real deployment on one machine.

    PATH=.venv/bin:$PATH python benchmarks/server_memory_flower.py --groups 2 4 --model medium \
        --out benchmarks/results/server_memory_flower.json

For each F: a SuperLink (which runs the ServerApp in its own `flwr-serverapp` process), F group torchrun jobs
(S = 1 by default) and F SuperNodes on loopback, then `flwr run apps/llama_fl_hsdp` with aggregation="server" and
this module's `PeakMemoryServerShardFedAvg` as the strategy: every round it records the ServerApp's peak RSS during
the round over its RSS before the first round, with the server path's code (torch) loaded (`server_peak_mib`;
`server_peak_x` in fp32 copies of the model; the baseline itself is `server_base_mib`), which this script collects.
In a local
simulation the same figure would also count the simulation engine (Ray's object store, the ClientApps' messages), so
the deployment is what shows the server's own memory. Everything started is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr_sharded import schema, tool_options
from flwr_sharded.config import DataConfig, ModelConfig, ParallelConfig
from flwr_sharded.flower import shard_files
from flwr_sharded.flower.run_config import FederationConfig
from flwr_sharded.flower.server.aggregation import check_piece_layout, fp32_bytes
from flwr_sharded.flower.server.server_path_strategy import ServerShardFedAvg
from flwr_sharded.parallel.shard_transport import decode_layouts
from flwr_sharded.host_memory import PeakRSS, current_rss
from flwr_sharded.schema import same_as

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.local_flower: the loopback deployment

from tests.local_flower import Procs, deployment_rounds  # noqa: E402
from flwr_sharded_perf.provenance import provenance  # noqa: E402

APP = REPO / "apps" / "llama_fl_hsdp"
STRATEGY = "benchmarks.server_memory_flower:PeakMemoryServerShardFedAvg"


class PeakMemoryServerShardFedAvg(ServerShardFedAvg):
    """ServerShardFedAvg that adds to each round's record the ServerApp's peak RSS during the round over its RSS
    before round 1 (`server_peak_mib`, `server_peak_x` in fp32 copies of the model, `server_base_mib`)."""

    _base: int | None = None
    _model_bytes = 0

    def run_round(self, grid: Any, server_round: int, result: Any, train_config: Any) -> None:
        if self._base is None:  # once, with the server path's code loaded
            self._base = current_rss()
        self._memory = PeakRSS(self._base)
        super().run_round(grid, server_round, result, train_config)

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        replies = list(replies)
        for reply in replies:  # the model's size, from a facility's manifest
            if not reply.has_error() and shard_files.SHARD_SHAPES in reply.content:
                shapes, meta, _ = shard_files.from_manifest_records(reply.content)
                self._model_bytes = fp32_bytes(check_piece_layout(None, decode_layouts(shapes, meta), complete=False))
        return super().aggregate_train(server_round, replies)

    def publish_round(self) -> None:
        extra = self._memory.extra_bytes()  # the round: train, then pulls, means and applies
        if extra is not None and self._model_bytes and self.history:
            self.history[-1].update(server_peak_mib=extra / 2**20, server_peak_x=extra / self._model_bytes,
                                    server_base_mib=self._base / 2**20)
        super().publish_round()


@dataclass
class RunOptions:
    """The run config's options of every run (the Flower app's own flags and docstrings)."""

    model: str = same_as(ModelConfig, "name", default="medium")
    shards: int = same_as(ParallelConfig, "shards")
    seq_len: int = same_as(DataConfig, "seq_len", default=16)
    rounds: int = same_as(FederationConfig, "rounds")
    server_buffer_mb: float = same_as(FederationConfig, "server_buffer_mb")
    data_dir: str = same_as(DataConfig, "data_dir", default=str(REPO / ".data"))


def measure(F: int, args: argparse.Namespace, work: Path) -> list[dict]:
    (work / f"F{F}").mkdir(parents=True)
    procs = Procs(work / f"F{F}")
    node_env = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(args.task_poll_interval)} if args.task_poll_interval else {}
    config = {"model": args.model, "shards": args.shards, "seq-len": args.seq_len, "batch-size": 1,
              "aggregate-every": 1, "syncs-per-round": 1, "num-server-rounds": args.rounds, "eval-blocks": 4,
              "evaluate-in-train": False, "aggregation": "server", "server-buffer-mb": args.server_buffer_mb,
              "num-groups": F, "data-dir": args.data_dir, "save-model": False, "strategy": STRATEGY}
    try:
        return deployment_rounds(procs, APP, [(f"group{i}", {"shards": args.shards}) for i in range(F)], config,
                                 timeout=args.timeout, node_env=node_env)
    except RuntimeError as exc:
        sys.exit(f"F = {F}: {exc}")
    finally:
        procs.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=schema.HelpFormatter)
    schema.add_arguments(p, RunOptions)
    p.add_argument("--groups", type=int, nargs="+", default=[2, 4], help="values of F")
    p.add_argument("--task-poll-interval", type=float, default=0.0,
                   help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL of the SuperNodes, in s (0: Flower's, 1 s)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--out", default="", help="result JSON (none when empty)")
    args = tool_options.parse_args(p, RunOptions)
    os.environ["FLWR_SHARDED_ALLOWED_IMPORTS"] = STRATEGY.partition(":")[0]  # the ServerApp imports this module
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for F in args.groups:
            start = time.monotonic()
            rounds = measure(F, args, Path(tmp))
            peaks = [r["server_peak_x"] for r in rounds]
            row = {"F": F, "server_peak_x_max": max(peaks), "server_peak_x_median": statistics.median(peaks),
                   "server_peak_mib_max": max(r["server_peak_mib"] for r in rounds),
                   "server_base_mib": rounds[0]["server_base_mib"],
                   "fp32_model_mib": rounds[0]["server_peak_mib"] / rounds[0]["server_peak_x"],
                   "pull_chunks": rounds[-1]["pull_chunks"], "apply_chunks": rounds[-1]["apply_chunks"],
                   "server_sync_s_median": statistics.median(r["server_sync_s"] for r in rounds),
                   "rounds": [{k: r[k] for k in ("round", "server_peak_mib", "server_peak_x", "server_sync_s")}
                              for r in rounds], "seconds": time.monotonic() - start}
            results.append(row)
            print(f"F = {F}: fp32 model {row['fp32_model_mib']:.1f} MiB; ServerApp RSS before round 1 "
                  f"{row['server_base_mib']:.0f} MiB, peak over it: max {row['server_peak_x_max']:.2f}x, median "
                  f"{row['server_peak_x_median']:.2f}x ({row['server_peak_mib_max']:.1f} MiB); "
                  f"{row['pull_chunks']} chunks pulled, {row['apply_chunks']} sent per group; server sync "
                  f"{row['server_sync_s_median']:.1f} s (median); {row['seconds']:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"provenance": provenance(), "config": vars(args),
                                              "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
