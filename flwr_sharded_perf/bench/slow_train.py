"""`python -m flwr_sharded_perf.bench.slow_train GROUP:SECONDS [train options]`: the static engine with one
federation group slowed down, every rank of it sleeping SECONDS after each optimizer step (the bench's slower group)."""

from __future__ import annotations

import runpy
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

from flwr_sharded.training.observer import SyncObserver, observe_every_loop

if TYPE_CHECKING:
    from flwr_sharded.training.sync_loop import SyncLoop


class SlowGroup(SyncObserver):
    """Every rank of federation group `group` sleeps `seconds` after each inner step, within the step's time."""

    def __init__(self, group: int, seconds: float) -> None:
        self.group, self.seconds = group, seconds

    def on_step_end(self, loop: SyncLoop, loss: Any) -> None:
        if loop.topo.fed_index == self.group:
            time.sleep(self.seconds)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    group, _, seconds = (argv.pop(0) if argv else "").partition(":")
    if not group.isdigit() or not seconds.replace(".", "", 1).isdigit():
        print("slow_train: the first argument is GROUP:SECONDS (e.g. 1:0.2)", file=sys.stderr)
        return 2
    observe_every_loop(lambda loop: SlowGroup(int(group), float(seconds)))
    sys.argv = ["flwr_sharded.train", *argv]
    runpy.run_module("flwr_sharded.train", run_name="__main__")  # the entry point as `python -m` runs it
    return 0


if __name__ == "__main__":
    sys.exit(main())
