"""`flwr-sharded bench`: the four methods side by side on an emulated tiered cluster (see `flwr_sharded.perf.netemu`).

Modules: `layouts` (each method's F x R x S, the model's FSDP2 units), `scenarios` (training runs inside the emulated
fabric, the planner's view, repeats merged), `report` (the targets' checks, the planner's agreement, Markdown),
`plots`, `subcommands` (what `bench exec`, `check` and `sync` do inside the namespaces) and `cli` (the command line and
the re-execution into fresh namespaces, whose inner entry point is `python -m flwr_sharded.perf.bench`).
"""

from flwr_sharded.perf.bench.cli import register

__all__ = ["register"]
