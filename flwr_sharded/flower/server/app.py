"""What a ServerApp of sharded groups does around its strategy: read and check the run, import its strategy, open its
directory, say how it ended.

Importing a module runs its code on the ServerApp's machine, and the run config is the submitter's: `strategy` and
`outer` are imported there only from the Flower app's own package (its code comes from the submitter anyway),
flwr_sharded, or the modules the operator allows in `FLWR_SHARDED_ALLOWED_IMPORTS` (comma-separated, each with its
submodules, or `*`) in the SuperLink's environment. The groups check `outer` against their node config.

A failed run must not look like a successful one (`flwr run --stream` exits 0 whatever happens): the last lines of
the stream say COMPLETED or FAILED with the reason, `summary.json` records the status, and the exception propagates.
A run stopped with `flwr stop` records `stopped` (Flower's exit handlers run; the ServerApp's thread does not learn
it), and the key material of the groups launched on this machine is removed.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from logging import ERROR, INFO
from typing import Any, Mapping

from flwr.superlink.grid.inmemory_grid import InMemoryGrid
from flwr.supercore import log
from flwr.supercore.exit import add_exit_handler

from flwr_sharded import schema
from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.launch import remove_key_material
from flwr_sharded.flower.run_config import RUN_CONFIG, FlowerRun
from flwr_sharded.flower.server.strategy import DecentralizedFedAvg
from flwr_sharded.run_dir import METRICS, RunDir, check_run_dir, default_run_dir

ALLOWED_IMPORTS_ENV = "FLWR_SHARDED_ALLOWED_IMPORTS"
"""The operator's allow-list on the ServerApp's machine (comma-separated module names, or `*`)."""
OWN_PACKAGE = "flwr_sharded"


def is_allowed(module: str, app_package: str = "") -> bool:
    """Whether the ServerApp may import `module`: the app's package, flwr_sharded, or the operator's list."""
    allowed = (name.strip() for name in os.environ.get(ALLOWED_IMPORTS_ENV, "").split(","))
    roots = (OWN_PACKAGE, app_package, *filter(None, allowed))
    return "*" in roots or any(root and (module == root or module.startswith(root + ".")) for root in roots)


def check_import(value: str, key: str, app_package: str = "") -> None:
    """ConfigError naming the run-config `key` unless `value` is `package.module:Class` and may be imported here."""
    label = RUN_CONFIG.label(schema.by_name(FlowerRun)[key])
    module, sep, attr = value.partition(":")
    if not sep or not attr.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
        raise RUN_CONFIG.error(f"{label} {value!r} must be package.module:Class")
    if is_allowed(module, app_package):
        return
    app = f"the app's package ({app_package}, e.g. {app_package}.strategies), " if app_package else ""
    raise RUN_CONFIG.error(f"{label} {value!r}: the ServerApp imports modules of {app}{OWN_PACKAGE} and those its "
                           f"operator allows, and {module!r} is none of them; ship the module inside the app, or set "
                           f"{ALLOWED_IMPORTS_ENV}={module} (comma-separated module names) in the "
                           f"environment the SuperLink runs in")


def check_run_imports(run: FlowerRun, app_package: str = "") -> None:
    """Check every import the run config asks of the ServerApp (`strategy`, an `outer` rule given by path)."""
    if run.federation.strategy:
        check_import(run.federation.strategy, "strategy", app_package)
    if ":" in run.train.parallel.outer:
        check_import(run.train.parallel.outer, "outer", app_package)


def load_run(run_config: Mapping[str, Any], grid: Any = None, app_package: str = "") -> FlowerRun:
    """The run of Flower's run config, validated, with the groups' model and data checks that can run here (all of
    them in a simulation, whose `grid` is Flower's in-memory one); a ConfigError names the key (logged once), before
    any group is launched. `app_package`: the Flower app's own package, whose modules `strategy` and `outer` may
    name."""
    try:
        run = FlowerRun.from_run_config(run_config)
        check_run_imports(run, app_package)
        run.validate()
        run.check_sources(local=isinstance(grid, InMemoryGrid))
        return run
    except ConfigError as exc:
        log(ERROR, "flwr_sharded: the run FAILED before it started: %s", exc)
        raise


def strategy_class(run: FlowerRun, app_package: str = "") -> type:
    """The `strategy` key's class (a DecentralizedFedAvg subclass, from a module the run may import), else the
    aggregation path's strategy."""
    name = run.federation.strategy
    if not name:
        if run.federation.aggregation == "server":
            from flwr_sharded.flower.server.server_path_strategy import ServerShardFedAvg

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
    the outcome written and announced when the block ends; `run`'s `run-dir` is set to it (a simulation's groups
    log to its `groups/`). The caller records the summary in `summary`."""
    out = run.train.output
    path = check_run_dir(out.run_dir, resume=run.train.checkpoint.resume, option="run config 'run-dir'") \
        if out.run_dir else default_run_dir(suffix=f"-run{run_id}")
    run_dir = RunDir(path, config=schema.to_nested(run), tensorboard=out.tensorboard,
                     wandb_project=out.wandb_project, name=f"run{run_id}")
    run_dir.summary = {}
    out.run_dir = str(run_dir.path)  # sent in the hellos
    if run.train.checkpoint.resume and (run_dir.path / METRICS).stat().st_size:  # rounds go on, one summary at the end
        run_dir.continue_from(run_dir.path, None, run.train.checkpoint.dir or "")
    log(INFO, "flwr_sharded: run directory %s", run_dir.path)
    recorded = threading.Lock()  # the first outcome to take it is the run's: stopped, failed or completed

    def on_exit() -> None:  # the process ends before the run did: stopped, recorded before Ray's shutdown fails it
        if recorded.acquire(blocking=False):
            stopped(run_dir, run_id)
            stop_ray()

    add_exit_handler(on_exit, run_before_force_exit=True)
    try:
        yield run_dir
    except BaseException as exc:
        if not recorded.acquire(blocking=False):
            raise  # stopped, and recorded so
        reason = f"{type(exc).__name__}: {exc}"
        run_dir.finish({"status": "failed", "error": reason, **run_dir.summary})
        log(ERROR, "flwr_sharded: the run FAILED: %s", reason)
        log(ERROR, "flwr_sharded: run directory %s (summary.json)", run_dir.path)
        raise
    if not recorded.acquire(blocking=False):
        return
    s = run_dir.summary
    run_dir.finish({"status": "completed", **s})
    ppl = ", ".join(f"{k.replace('final_', '').replace('_', ' ')} {s[k]:.2f}"
                    for k in ("final_train_ppl", "final_eval_ppl") if isinstance(s.get(k), (int, float)))
    log(INFO, "flwr_sharded: the run COMPLETED: %s round(s)%s", s.get("rounds", 0), f", {ppl}" if ppl else "")
    log(INFO, "flwr_sharded: run directory %s (metrics.jsonl, summary.json%s)", run_dir.path,
        ", model/" if s.get("model") else "")


def stopped(run_dir: RunDir, run_id: int) -> None:
    """The run's process is ending before the run did (`flwr stop`: Flower runs its exit handlers, the ServerApp's
    thread is abandoned): the run directory says so, and the key material of the groups launched on this machine
    is removed."""
    try:  # Flower's exit handlers swallow what they raise: say it here
        run_dir.finish({"status": "stopped", "error": "the run was stopped before it ended (flwr stop, or its "
                                                      "process was ended)", **run_dir.summary})
        removed = remove_key_material(run_id)
    except Exception as exc:  # noqa: BLE001 - logged; the process is ending either way
        log(ERROR, "flwr_sharded: the run was STOPPED, and recording it failed: %s: %s", type(exc).__name__, exc)
        return
    log(ERROR, "flwr_sharded: the run was STOPPED; run directory %s (summary.json)%s", run_dir.path,
        f"; removed the key material of {len(removed) // 2} group(s)" if removed else "")


RAY_SHUTDOWN_S = 15.0
"""How long a stopped run waits for `ray.shutdown` before its process ends anyway."""


def stop_ray() -> None:
    """In local simulation the run's process is Ray's driver: a stopped run ends Ray's processes now, with SIGTERM
    (`ray.shutdown`, at most `RAY_SHUTDOWN_S`), before Flower's forced exit skips Ray's own shutdown; with raylet
    killed instead, Ray's two agents try for up to a minute to report it to a GCS that is gone before they exit."""
    ray = sys.modules.get("ray")  # a driver has imported it; nothing to do elsewhere
    if ray is None or not ray.is_initialized():
        return

    def shutdown() -> None:
        try:
            ray.shutdown()
        except Exception as exc:  # noqa: BLE001 - logged; the process is ending either way
            log(ERROR, "flwr_sharded: stopping Ray failed: %s: %s", type(exc).__name__, exc)

    worker = threading.Thread(target=shutdown, name="ray-shutdown", daemon=True)
    worker.start()
    worker.join(RAY_SHUTDOWN_S)
    if worker.is_alive():
        log(ERROR, "flwr_sharded: Ray did not shut down within %.0f s; the run's process ends anyway", RAY_SHUTDOWN_S)


def record_outcome(run_dir: RunDir, strategy: Any) -> None:
    """Put the strategy's summary and the saved model's place into the run directory's summary."""
    summary = next((h for h in reversed(strategy.history) if h.get("kind") == "summary"), {})
    run_dir.summary.update({k: v for k, v in summary.items() if k != "kind"}, model=strategy.saved_model)
