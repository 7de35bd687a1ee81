"""`flwr-sharded bench`: the methods side by side on an emulated tiered cluster (docs/benchmarking.md)."""

from flwr_sharded_perf.bench.cli import register

__all__ = ["register"]
