"""What a ServerApp of sharded groups does around its strategy: read the run, open its directory, say how it ended.

A failed run must not look like a successful one: `flwr run --stream` exits 0 whatever happens, so the last lines
of the stream say COMPLETED or FAILED with the reason, `summary.json` records the status, and the exception
propagates (Flower then marks the run failed, as `flwr ls` shows).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from logging import ERROR, INFO
from typing import Any, Mapping

from flwr.supercore import log

from flwr_sharded import schema
from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.run_config import RUN_CONFIG, FlowerRun
from flwr_sharded.flower.server.imports import check_import, check_run_imports
from flwr_sharded.run_dir import METRICS, RunDir, check_run_dir, default_run_dir


def load_run(run_config: Mapping[str, Any], grid: Any = None, app_package: str = "") -> FlowerRun:
    """The run described by Flower's run config, validated, with the groups' model and data checks that can run
    here (`FlowerRun.check_sources`: all of them in a simulation, whose `grid` is Flower's in-memory one); the
    ConfigError names the key (and is logged once), before any group is launched.

    `app_package`: the Flower app's own package, whose modules `strategy` and `outer` may name (`imports`); any
    other module must be allowed by the ServerApp's operator, and is checked before anything is imported."""
    try:
        run = FlowerRun.from_run_config(run_config)
        check_run_imports(run, app_package)
        run.validate()
        run.check_sources(local=is_simulation(grid))
        return run
    except ConfigError as exc:
        log(ERROR, "flwr_sharded: the run FAILED before it started: %s", exc)
        raise


def is_simulation(grid: Any) -> bool:
    """Whether `grid` is a simulation's (Flower's in-memory Grid: the ServerApp and the ClientApps share a machine)."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


def strategy_class(run: FlowerRun, app_package: str = "") -> type:
    """The `strategy` key's class (a DecentralizedFedAvg subclass, from a module `imports` allows), else the
    aggregation path's strategy."""
    from flwr_sharded.flower.server.strategy import DecentralizedFedAvg

    name = run.federation.strategy
    if not name:
        if run.federation.aggregation == "server":
            from flwr_sharded.flower.server.server_path import ServerShardFedAvg

            return ServerShardFedAvg
        return DecentralizedFedAvg
    label = RUN_CONFIG.label(schema.by_name(FlowerRun)["strategy"])
    check_import(name, "strategy", app_package)  # before the import runs the module's code
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RUN_CONFIG.error(f"{label} {name!r}: cannot import it here: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, DecentralizedFedAvg)):
        raise RUN_CONFIG.error(f"{label} {name!r} is not a subclass of DecentralizedFedAvg")
    return cls


@contextmanager
def run_directory(run: FlowerRun, run_id: int) -> Iterator[RunDir]:
    """The run's directory (the `run-dir` key, else outputs/<date>_<time>-run<id> where the ServerApp runs), with
    the outcome written and announced when the block ends; `run`'s `run-dir` is set to it (the groups a simulation
    launches log to its `groups/`). The caller records the summary in `summary`."""
    out = run.train.output
    path = check_run_dir(out.run_dir, resume=run.train.checkpoint.resume, option="run config 'run-dir'") \
        if out.run_dir else default_run_dir(suffix=f"-run{run_id}")
    run_dir = RunDir(path, config=schema.to_nested(run), tensorboard=out.tensorboard,
                     wandb_project=out.wandb_project, name=f"run{run_id}")
    run_dir.summary = {}
    out.run_dir = str(run_dir.path)  # sent in the hellos: a simulation's groups log to <run-dir>/groups/
    if run.train.checkpoint.resume and (run_dir.path / METRICS).stat().st_size:  # rounds go on, one summary at the end
        run_dir.continue_from(run_dir.path, None, run.train.checkpoint.dir or "")
    log(INFO, "flwr_sharded: run directory %s", run_dir.path)
    try:
        yield run_dir
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        run_dir.finish({"status": "failed", "error": reason, **run_dir.summary})
        log(ERROR, "flwr_sharded: the run FAILED: %s", reason)
        log(ERROR, "flwr_sharded: run directory %s (summary.json)", run_dir.path)
        raise
    s = run_dir.summary
    run_dir.finish({"status": "completed", **s})
    ppl = ", ".join(f"{k.replace('final_', '').replace('_', ' ')} {s[k]:.2f}" for k in ("final_train_ppl",
                                                                                       "final_eval_ppl")
                    if isinstance(s.get(k), (int, float)))
    log(INFO, "flwr_sharded: the run COMPLETED: %s round(s)%s", s.get("rounds", 0), f", {ppl}" if ppl else "")
    log(INFO, "flwr_sharded: run directory %s (metrics.jsonl, summary.json%s)", run_dir.path,
        ", model/" if s.get("model") else "")


def record_outcome(run_dir: RunDir, strategy: Any) -> None:
    """Put the strategy's summary and the saved model's place into the run directory's summary."""
    summary = next((h for h in reversed(strategy.history) if h.get("kind") == "summary"), {})
    run_dir.summary.update({k: v for k, v in summary.items() if k != "kind"}, model=strategy.saved_model)
