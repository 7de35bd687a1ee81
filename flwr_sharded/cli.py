"""`flwr-sharded` command: one sub-command per concern, each registered by the module that implements it."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from flwr_sharded import options_doc, plot
    from flwr_sharded.flower import check, superlink
    from flwr_sharded.perf import bench, plan_cli
    from flwr_sharded.training import corpus, export_cli

    parser = argparse.ArgumentParser(prog="flwr-sharded", description="Sharded data parallelism with federated "
                                     "learning on Flower: training, data preparation, planning, plots, run-config "
                                     "checks.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train one model: one process directly, N = F x R x S under torchrun "
                   "(`torchrun --nproc-per-node N --no-python flwr-sharded train ...`); see `train --help`",
                   add_help=False)  # dispatched in main(): its options are flwr_sharded.train's
    corpus.register(sub)
    export_cli.register(sub)
    plan_cli.register(sub)
    bench.register(sub)
    plot.register(sub)
    check.register(sub)
    options_doc.register(sub)
    superlink.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from flwr_sharded.train import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
