"""`flwr-sharded bench`: the four methods side by side on an emulated tiered cluster (`flwr_sharded.perf.netemu`).

Modules: `options`, `cli` (the command line, the re-execution into fresh namespaces as `python -m
flwr_sharded.perf.bench`, and `bench exec`, `check` and `sync`), `layouts` (the runs), `training_run`, `scenarios` and
`unequal_scenario` (inside the namespaces), `report`.
"""

from flwr_sharded.perf.bench.cli import register

__all__ = ["register"]
