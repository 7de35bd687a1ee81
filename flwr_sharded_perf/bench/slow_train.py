"""`python -m flwr_sharded_perf.bench.slow_train GROUP:SECONDS [train options]`: the static engine with one
federation group slowed down, every rank of it sleeping SECONDS after each optimizer step (the bench's slower group)."""

from __future__ import annotations

import runpy
import sys
import time
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from flwr_sharded.training.trainer import Trainer

    argv = list(sys.argv[1:] if argv is None else argv)
    group, _, seconds = (argv.pop(0) if argv else "").partition(":")
    if not group.isdigit() or not seconds.replace(".", "", 1).isdigit():
        print("slow_train: the first argument is GROUP:SECONDS (e.g. 1:0.2)", file=sys.stderr)
        return 2
    step = Trainer.step

    def slow_step(self: Trainer):  # noqa: ANN202 - the trainer's own step, then the group's sleep
        loss = step(self)
        if self.topo.fed_index == int(group):
            time.sleep(float(seconds))
        return loss

    Trainer.step = slow_step
    sys.argv = ["flwr_sharded.train", *argv]
    runpy.run_module("flwr_sharded.train", run_name="__main__")  # the entry point as `python -m` runs it
    return 0


if __name__ == "__main__":
    sys.exit(main())
