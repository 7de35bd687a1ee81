"""`flwr-sharded bench`: the four methods side by side on an emulated tiered cluster (`flwr_sharded.perf.netemu`).

Modules: `options`, `cli` (the command line and the re-execution into fresh namespaces, `python -m
flwr_sharded.perf.bench`), `layouts` (the runs), `training_run`, `scenarios` and `unequal_scenario` (inside the
namespaces), `report`, `plots` and `subcommands` (`bench exec`, `check` and `sync`).
"""

from flwr_sharded.perf.bench.cli import register

__all__ = ["register"]
