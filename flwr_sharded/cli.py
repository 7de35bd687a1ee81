"""`flwr-sharded` command: one sub-command per concern, each registered by the module that implements it (`train` and
`export`, whose modules import torch, are dispatched here)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from flwr_sharded.errors import ConfigError


def command_parser() -> argparse.ArgumentParser:
    """`flwr-sharded`'s parser: its sub-commands, each registered by its module."""
    from flwr_sharded import options_doc, plot
    from flwr_sharded.flower import check, superlink
    from flwr_sharded_perf import bench, plan_cli
    from flwr_sharded.training import corpus

    parser = argparse.ArgumentParser(prog="flwr-sharded", description="Sharded data parallelism with federated "
                                     "learning on Flower: training, data preparation, planning, plots, run-config "
                                     "checks.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train one model: one process directly, N = F x R x S under torchrun "
                   "(`torchrun --nproc-per-node N --no-python flwr-sharded train ...`); see `train --help`",
                   add_help=False)  # dispatched in main(): its options are flwr_sharded.train's
    corpus.register(sub)
    export = sub.add_parser("export", help="merge a checkpoint's shards into a Hugging Face model",
                            description="Write the model of a sharded checkpoint as a Hugging Face model, one tensor "
                            "at a time.")
    export.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory (step-N) or a group's series (uses its newest)")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="dtype of the written tensors (default: as in the checkpoint)")
    export.set_defaults(func=_export)
    plan_cli.register(sub)
    bench.register(sub)
    plot.register(sub)
    check.register(sub)
    options_doc.register(sub)
    superlink.register(sub)
    return parser


def _export(args: argparse.Namespace) -> int:
    """`flwr-sharded export`: `checkpoint_export.export_pretrained` (torch is imported when it runs)."""
    import torch

    from flwr_sharded.training.checkpoint_export import export_pretrained

    try:
        print(f"wrote {export_pretrained(args.checkpoint, args.out, dtype=args.dtype and getattr(torch, args.dtype))}")
    except ConfigError as exc:
        print(f"flwr-sharded export: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from flwr_sharded.train import main as train_main

        return train_main(argv[1:])
    args = command_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
