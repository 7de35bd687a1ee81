"""`flwr-sharded bench`: the four methods side by side on an emulated tiered cluster (`flwr_sharded.perf.netemu`).
Modules: `options`, `cli` (the command line, `bench exec`, `check` and `sync`, the re-execution into fresh namespaces as
`python -m flwr_sharded.perf.bench`), `runs`, `scenarios` (inside them), `report`."""

from flwr_sharded.perf.bench.cli import register

__all__ = ["register"]
