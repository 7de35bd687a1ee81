"""Static-world training entry point: `torchrun --nproc-per-node N -m flwr_sharded.train [options]`.

Runs any of the four methods (fsdp, hsdp, fl-fsdp, fl-hsdp) on F x R x S = N processes, launched by torchrun
(`torchrun --nproc-per-node N -m flwr_sharded.train`, or `torchrun --nproc-per-node N --no-python flwr-sharded
train`); a run of one process (F x R x S = 1) also runs without torchrun. Options come from
`--config FILE` (YAML, sections as in `flwr_sharded.config`) and the command line, which wins; every flag is a field
of `flwr_sharded.config.TrainConfig`. Everything is validated before a process group is started. The run writes its
directory (`--run-dir`, default outputs/<date>_<time>): config.json, metrics.jsonl, summary.json and model/. With
`--resume` it continues the run directory of the run its checkpoint came from (unless `--run-dir` names another,
which then starts with that run's metrics up to the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import socket
import sys
from typing import Any, Sequence

from flwr_sharded import host_memory, schema
from flwr_sharded.config import TrainConfig, config_to_dict, load_config
from flwr_sharded.validation import validate, validate_static
from flwr_sharded.errors import ConfigError
from flwr_sharded.training.preflight import preflight


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flwr-sharded train", description=__doc__,
                                     formatter_class=schema.HelpFormatter)
    parser.add_argument("--config", help="YAML file with the same options (sections parallel, model, data, optim, "
                                         "checkpoint, output)")
    parser.add_argument("--print-config", action="store_true", help="validate, print the resolved config and exit")
    parser.add_argument("--measure-traffic", metavar="DIR", default=None,
                        help="count each rank's collectives and interface bytes during optimizer steps and syncs; "
                             "write DIR/rank<N>.json (`flwr_sharded.parallel.traffic.TrafficProbe`)")
    schema.add_arguments(parser, TrainConfig)
    return parser


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """YAML (if any) overridden by the options given on the command line."""
    cfg = load_config(args.config) if args.config else TrainConfig()
    return schema.apply_arguments(cfg, args)


def join_world(cfg: TrainConfig, argv: Sequence[str]) -> None:
    """Make this process a rank of a world of F x R x S processes. Under torchrun (WORLD_SIZE set) the world must be
    that size; without it a one-process run gets a world of one here (rank 0, a free loopback port), and a larger run
    is a ConfigError naming the torchrun command that launches it with the same options `argv`."""
    p = cfg.parallel
    command = " ".join(["torchrun", "--nproc-per-node", str(p.world_size), "-m", "flwr_sharded.train", *map(
        shlex.quote, argv)])
    if "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != p.world_size:
            raise ConfigError(f"world size {os.environ['WORLD_SIZE']} != {p.describe_layout()}; launch it with: "
                              f"{command} (or change --federations/--replicas/--shards/--group-shards)")
        return
    if p.world_size != 1:
        layout = (p.describe_layout() if p.group_shards else
                  f"F x R x S = {p.federations} x {p.replicas} x {p.shards} = {p.world_size}")
        raise ConfigError(f"this run needs {layout} processes; launch it with: {command}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def run(cfg: TrainConfig, measure_traffic: str | None = None) -> dict[str, Any]:
    """Train in the current torchrun world, write the run directory, and return rank 0's final metrics.

    `measure_traffic`: a directory where every rank writes the bytes it sent during steps and syncs.
    """
    import torch.distributed as dist

    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.run_dir import RunDir, default_run_dir
    from flwr_sharded.training.static_run import StaticRun
    from flwr_sharded.training.sync_loop import SyncLoop
    from flwr_sharded.training.trainer import Trainer, effective_batch

    topo = init_topology(cfg.parallel, cfg.timeout_s)
    leader = dist.get_rank() == 0
    recorder = None
    try:
        box = [cfg.output.run_dir or (str(default_run_dir()) if leader else None)]
        dist.broadcast_object_list(box, src=0)  # every rank writes its part of the model there
        cfg.output.run_dir = box[0]
        trainer = Trainer(cfg, topo)
        loop = SyncLoop(trainer)
        host_memory.after_load()  # the load's transient buffers
        resumed = loop.resume() if cfg.checkpoint.resume else None  # before the run directory continues
        if leader:
            recorder = RunDir(cfg.output.run_dir, config=config_to_dict(cfg), tensorboard=cfg.output.tensorboard,
                              wandb_project=cfg.output.wandb_project)
            if resumed is not None and trainer.resumed_from is not None:
                previous = resumed["config"].get("output", {}).get("run_dir") or recorder.path
                recorder.continue_from(previous, *trainer.resumed_from)
            logging.info("run directory: %s", recorder.path)
            recorder.log({"kind": "start", "layout": topo.describe(), "world_size": cfg.parallel.world_size,
                          "effective_batch": effective_batch(cfg),
                          "effective_batch_tokens": effective_batch(cfg) * cfg.data.seq_len,
                          "parameters": sum(p_.numel() for p_ in trainer.model.parameters())})
            sync = f"; shard sync every {cfg.parallel.aggregate_every} steps: {cfg.parallel.describe_sync()}" \
                if cfg.parallel.federated else ""
            logging.info("%s; effective batch %d sequences per optimizer step%s", topo.describe(),
                         effective_batch(cfg), sync)
        probe = None
        if measure_traffic:
            from flwr_sharded.parallel.traffic import TrafficProbe
            from flwr_sharded.training.observer import TrafficWindows

            probe = TrafficProbe.from_env()
            loop.observers.append(TrafficWindows(probe))
        final = StaticRun(loop, recorder).run()
        if probe is not None:
            probe.finish()
            probe.write(measure_traffic)
        model_dir = ""
        if cfg.output.save_model:
            model_dir = f"{cfg.output.run_dir}/model"
            trainer.save_pretrained(model_dir)
        if recorder is not None:
            recorder.finish({"status": "completed", "steps": trainer.step_count, "model": model_dir,
                             **{k: v for k, v in final.items() if k != "kind"}})
            logging.info("run directory: %s (metrics.jsonl, summary.json%s)", recorder.path,
                         ", model/" if model_dir else "")
        return final
    except BaseException as exc:
        if recorder is not None:
            recorder.finish({"status": "failed", "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    host_memory.pin_thresholds()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = train_parser().parse_args(argv)
    leader = int(os.environ.get("RANK", "0")) == 0
    try:
        cfg = resolve_config(args)
        validate(cfg)
        validate_static(cfg)
        if args.print_config:
            print(json.dumps(config_to_dict(cfg), indent=2))
            return 0
        join_world(cfg, argv)
        preflight(cfg, int(os.environ["WORLD_SIZE"]))
    except ConfigError as exc:
        if leader:
            print(f"flwr-sharded: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from flwr_sharded.training.checkpoint import CheckpointWriteError
    from flwr_sharded.training.federation import SyncFailed

    try:
        final = run(cfg, measure_traffic=args.measure_traffic)
    except ConfigError as exc:  # found once the data is opened (e.g. a hub dataset that needs a loading script)
        if leader:
            print(f"flwr-sharded: error: {exc}", file=sys.stderr)
        return 2
    except (SyncFailed, CheckpointWriteError) as exc:  # every rank stops at the same sync or checkpoint
        if leader:
            print(f"flwr-sharded: error: {exc}", file=sys.stderr)
        return 1
    if leader and final:
        print(json.dumps({k: v for k, v in final.items() if k != "kind"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
