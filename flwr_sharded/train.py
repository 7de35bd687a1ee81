"""Static-world training entry point: `torchrun --nproc-per-node N -m flwr_sharded.train [options]`.

Runs any of the four methods (fsdp, hsdp, fl-fsdp, fl-hsdp) on F x R x S = N processes. Options come from
`--config FILE` (YAML) and the command line, which wins. Everything is validated before a process group is started.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence

from flwr_sharded.config import (METHODS, OPTIMIZERS, PARTITIONS, PRECISIONS, SYNC_DTYPES, TrainConfig,
                                 config_to_dict, load_config, validate)
from flwr_sharded.errors import ConfigError

# option -> (section or None for top level, field name, type, help)
OPTIONS: list[tuple[str, str | None, str, Any, str]] = [
    ("--method", "parallel", "method", str, f"one of {', '.join(METHODS)}"),
    ("--federations", "parallel", "federations", int, "F, federation groups"),
    ("--replicas", "parallel", "replicas", int, "R, replication groups per federation group"),
    ("--shards", "parallel", "shards", int, "S, ranks per model replica"),
    ("--aggregate-every", "parallel", "aggregate_every", int, "A, optimizer steps between shard syncs"),
    ("--bucket-mb", "parallel", "bucket_mb", float, "shard-sync bucket size in MiB"),
    ("--outer", "parallel", "outer", str, "sync rule: fedavg, fedavgm, nesterov, fedadam, fedyogi, trimmed-mean"),
    ("--outer-lr", "parallel", "outer_lr", float, "outer learning rate (default: the rule's)"),
    ("--outer-momentum", "parallel", "outer_momentum", float, "outer momentum (fedavgm, nesterov)"),
    ("--sync-dtype", "parallel", "sync_dtype", str, f"wire dtype of the shard sync: {', '.join(SYNC_DTYPES)} "
                                                    f"(bfloat16 sends the delta from the global model)"),
    ("--model", "model", "name", str, "preset, Hugging Face id or local directory"),
    ("--precision", "model", "precision", str, f"one of {', '.join(PRECISIONS)}"),
    ("--dataset", "data", "dataset", str, "shakespeare, a Hugging Face dataset id or a local file"),
    ("--dataset-config", "data", "dataset_config", str, "hub dataset configuration (subset) name"),
    ("--data-dir", "data", "data_dir", str, "prepared data directory"),
    ("--tokenizer", "data", "tokenizer", str, "tokenizer id or path"),
    ("--seq-len", "data", "seq_len", int, "tokens per block"),
    ("--partition", "data", "partition", str, f"one of {', '.join(PARTITIONS)}"),
    ("--max-train-blocks", "data", "max_train_blocks", int, "use at most this many training blocks"),
    ("--eval-blocks", "data", "eval_blocks", int, "held-out blocks per evaluation"),
    ("--optimizer", "optim", "optimizer", str, f"one of {', '.join(OPTIMIZERS)}"),
    ("--lr", "optim", "lr", float, "peak learning rate"),
    ("--weight-decay", "optim", "weight_decay", float, "weight decay"),
    ("--warmup", "optim", "warmup", float, "warm-up: fraction of steps (< 1) or steps"),
    ("--min-lr-ratio", "optim", "min_lr_ratio", float, "cosine floor as a fraction of --lr"),
    ("--grad-clip", "optim", "grad_clip", float, "global gradient-norm clip; 0 turns it off"),
    ("--steps", None, "steps", int, "optimizer steps"),
    ("--batch-size", None, "batch_size", int, "sequences per rank per micro-batch"),
    ("--grad-accum", None, "grad_accum", int, "micro-batches per optimizer step"),
    ("--seed", None, "seed", int, "random seed"),
    ("--eval-every", None, "eval_every", int, "evaluate every N steps (0: at the end only)"),
    ("--log-every", None, "log_every", int, "log every N steps"),
    ("--metrics", None, "metrics", str, "JSON-lines metrics file"),
    ("--tensorboard", None, "tensorboard", str, "TensorBoard directory"),
    ("--save", None, "save", str, "write group 0's merged model here (save_pretrained)"),
    ("--checkpoint-dir", None, "checkpoint_dir", str, "write sharded checkpoints under this directory"),
    ("--checkpoint-every", None, "checkpoint_every", int, "checkpoint every N steps (and at the end)"),
    ("--keep-checkpoints", None, "keep_checkpoints", int, "complete checkpoints kept per group"),
    ("--timeout", None, "timeout_s", float, "collective timeout in seconds"),
]
FLAGS: list[tuple[str, str | None, str, str]] = [
    ("--reset-optimizer-state", "parallel", "reset_optimizer_state", "clear inner optimizer state at each sync"),
    ("--no-sync", "parallel", "sync", "FL methods without syncing (the no-sync limit, for benchmarks)"),
    ("--activation-checkpointing", "model", "activation_checkpointing", "recompute block activations"),
    ("--no-reshard-after-forward", "model", "reshard_after_forward", "keep gathered parameters until backward"),
    ("--pretrained", "model", "pretrained", "load pretrained weights for hub ids / directories"),
    ("--resume", None, "resume", "continue from the newest checkpoint in --checkpoint-dir"),
    ("--async-checkpoint", None, "async_checkpoint", "write checkpoints in the background"),
    ("--no-progress", None, "progress", "hide the progress bar"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flwr-sharded train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with the same options (sections parallel/model/data/optim)")
    for flag, _, _, typ, help_ in OPTIONS:
        parser.add_argument(flag, type=typ, default=None, help=help_)
    for flag, _, _, help_ in FLAGS:
        parser.add_argument(flag, action="store_true", default=None, help=help_)
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--measure-traffic", metavar="DIR", default=None,
                        help="count each rank's collectives and interface bytes during optimizer steps and syncs; "
                             "write DIR/rank<N>.json (see flwr_sharded.perf.traffic_report)")
    return parser


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """YAML (if any) overridden by the options given on the command line."""
    cfg = load_config(args.config) if args.config else TrainConfig()
    for flag, section, name, *_ in OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            setattr(getattr(cfg, section) if section else cfg, name, value)
    for flag, section, name, _ in FLAGS:
        if getattr(args, flag[2:].replace("-", "_")):
            setattr(getattr(cfg, section) if section else cfg, name, not flag.startswith("--no-"))
    return cfg


def preflight(cfg: TrainConfig, world_size: int) -> None:
    """Every check that can run before a process group, a model or a file is touched."""
    from flwr_sharded.training.data import check_data
    from flwr_sharded.training.models import check_model_name, is_preset

    validate(cfg, world_size)
    check_model_name(cfg.model.name)
    if cfg.model.pretrained and not is_preset(cfg.model.name):
        from flwr_sharded.training.pretrained import check_pretrained

        check_pretrained(cfg.model.name)  # config.json and safetensors headers only
    check_data(cfg.data)
    if cfg.resume:
        from flwr_sharded.training.checkpoint import check_resumable

        check_resumable(cfg, cfg.checkpoint_dir)


def run(cfg: TrainConfig, measure_traffic: str | None = None) -> dict[str, Any]:
    """Train in the current torchrun world and return rank 0's final metrics.

    `measure_traffic`: a directory where every rank writes the bytes it sent during steps and syncs.
    """
    import torch.distributed as dist

    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.trainer import Trainer, effective_batch

    topo = init_topology(cfg.parallel, cfg.timeout_s)
    try:
        trainer = Trainer(cfg, topo)
        probe = None
        if measure_traffic:
            from flwr_sharded.perf.traffic_report import TrafficProbe

            probe = TrafficProbe.from_env()
            probe.attach(trainer)
        if dist.get_rank() == 0:
            logging.info("%s; effective batch %d sequences per optimizer step", topo.describe(),
                         effective_batch(cfg))
        final = trainer.run()
        if probe is not None:
            probe.finish()
            probe.write(measure_traffic)
        return final
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = resolve_config(args)
        if args.print_config:
            print(json.dumps(config_to_dict(cfg), indent=2))
            return 0
        preflight(cfg, world_size)
    except ConfigError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"flwr-sharded: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    final = run(cfg, measure_traffic=args.measure_traffic)
    if int(os.environ.get("RANK", "0")) == 0 and final:
        print(json.dumps({k: v for k, v in final.items() if k != "kind"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
