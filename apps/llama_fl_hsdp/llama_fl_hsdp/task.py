"""Run-config handling shared by the ServerApp and the ClientApp (no torch)."""

from __future__ import annotations

from typing import Any, Mapping

from flwr_sharded.flower.protocol import RunSpec
from flwr_sharded.flower.strategy import Deadlines, deadlines_from_run_config


def run_spec(run_config: Mapping[str, Any]) -> RunSpec:
    """The training settings (model, layout, schedule, data) of this run."""
    return RunSpec.from_run_config(run_config)


def deadlines(run_config: Mapping[str, Any]) -> Deadlines:
    """Waits and group counts of the strategy."""
    return deadlines_from_run_config(dict(run_config))


def flag(run_config: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = run_config.get(key, default)
    return value.lower() == "true" if isinstance(value, str) else bool(value)
