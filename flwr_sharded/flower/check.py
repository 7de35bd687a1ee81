"""`flwr-sharded check`: a run config checked as the ServerApp checks it, before `flwr run` submits it.

Flower refuses a key the app's `[tool.flwr.app.config]` lacks with only `Invalid run configuration.` (the key is in
the SuperLink's log). This reads the overrides with Flower's parser (`'key=value key2="text"'`, or a `.toml` file),
fuses them with the app's defaults and runs the ServerApp's checks (schema, allowed imports, `validate`, and model
and data as on this machine unless `--deployment`), naming a bad key and, for a typo, the closest ones.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr_sharded import schema
from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.run_config import RUN_CONFIG, FlowerRun
from flwr_sharded.flower.server.app import check_run_imports

_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")
"""A `key=value` pair as `parse_config_args` finds it; text outside such pairs is what Flower ignores."""


@dataclass
class CheckOptions:
    """`flwr-sharded check`: check a run config against the app's keys and the run's schema."""

    app: str = "apps/llama_fl_hsdp"
    """The Flower app's directory, as given to `flwr run` (its pyproject.toml's `[tool.flwr.app.config]` holds the
    keys Flower accepts)."""
    run_config: str | None = None
    """Overrides as `flwr run --run-config` takes them: 'key=value key2="text"' (TOML values), or a .toml file;
    repeat it as for `flwr run`."""
    deployment: bool = False
    """The groups run on other machines: skip the checks of the data directory, the tokenizer and the model's files
    and cache, which only their nodes can make (a local simulation's groups use this machine's)."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `check` sub-command (options: `CheckOptions`; `--run-config` repeats, as `flwr run`'s)."""
    p = subparsers.add_parser("check", help="check a run config (`flwr run --run-config`) against the app, naming a "
                                            "bad key", description=__doc__, formatter_class=schema.HelpFormatter)
    schema.add_arguments(p, CheckOptions, skip=("run-config",))
    o = schema.by_name(CheckOptions)["run-config"]
    action = p.add_argument(f"--{o.name}", "-c", dest="run_config", action="append", default=[], metavar="TEXT",
                            help=schema.help_text(o).replace("%", "%%"))
    action.option = o
    p.set_defaults(func=_run_check)
    return p


def overrides(run_config: list[str]) -> dict[str, Any]:
    """The flat overrides of `flwr run --run-config` arguments, parsed by Flower; ConfigError for what Flower would
    refuse (malformed TOML, a missing file) or silently skip (text that is no `key=value` pair)."""
    import click
    import tomli
    from flwr.common.config import parse_config_args

    for text in (t for t in run_config if not t.endswith(".toml")):
        stray = _PAIR.sub(" ", text).split()
        if stray:
            raise ConfigError(f"--run-config: {stray[0]!r} is not a key=value pair (flwr run would skip it); "
                              f"write 'key=value key2=\"text\"'")
        for key, value in _PAIR.findall(text):
            try:
                tomli.loads(f"{key} = {value}")
            except tomli.TOMLDecodeError:
                raise ConfigError(f"run config '{key}': {value} is not a TOML value (bool, int, float, or a string "
                                  f"in quotes: {key}=\"{value.strip(chr(39))}\")") from None
    try:
        return parse_config_args(run_config or None)
    except click.ClickException as exc:
        raise ConfigError(f"--run-config: {exc.format_message()}") from None
    except (OSError, ValueError, tomli.TOMLDecodeError) as exc:
        raise ConfigError(f"--run-config: {exc}") from None


def app_table(app: str | Path) -> dict[str, Any]:
    """The `[tool.flwr.app]` table of the app at `app`, read as Flower reads it."""
    from flwr.common.config import get_project_config

    path = Path(app).expanduser()
    if not (path / "pyproject.toml").is_file():
        raise ConfigError(f"--app {app}: no pyproject.toml there; give the directory you pass to `flwr run`")
    try:
        return get_project_config(path)["tool"]["flwr"]["app"]
    except ValueError as exc:
        raise ConfigError(f"--app {app}: {exc}") from None


def app_defaults(app: str | Path) -> dict[str, Any]:
    """The flat `[tool.flwr.app.config]` of the app at `app`."""
    from flwr.common.config import flatten_dict

    return flatten_dict(app_table(app).get("config", {}))


def app_package(app: str | Path) -> str:
    """The top-level package of the app's ServerApp (`[tool.flwr.app.components] serverapp`)."""
    return str(app_table(app).get("components", {}).get("serverapp", "")).split(".")[0].split(":")[0]


def check(app: str | Path, run_config: list[str], *, local: bool = True) -> FlowerRun:
    """The run `flwr run <app> --run-config ...` would start, checked as the ServerApp checks it (`local`: with the
    model and data checks of a simulation on this machine); ConfigError naming the first bad key (and closest ones)."""
    given, defaults = overrides(run_config), app_defaults(app)
    run = FlowerRun.from_run_config({**defaults, **given})  # an unknown key: "did you mean ...?"
    missing = sorted(set(given) - set(defaults))
    if missing:
        raise RUN_CONFIG.error(f"'{missing[0]}' is not a key of the app's [tool.flwr.app.config] ({app}); Flower "
                               f"refuses it")
    check_run_imports(run, app_package(app))  # with this machine's FLWR_SHARDED_ALLOWED_IMPORTS
    run.validate()
    run.check_sources(local=local)
    return run


def run_summary(run: FlowerRun) -> str:
    """One line: method, groups, rounds x K x A, model and the shard sync."""
    p, f, d = run.train.parallel, run.federation, run.deadlines
    groups = f"{d.num_groups} groups" if d.num_groups else "the groups connected within sample-timeout"
    return (f"{p.method}, {groups} of R={p.replicas} x S={p.shards} ranks ({f.aggregation}); {f.rounds} rounds x "
            f"K={f.syncs_per_round} syncs x A={p.aggregate_every} steps = {run.total_steps} steps; model "
            f"{run.train.model.name}; sync {p.describe_sync()}")


def _run_check(args: argparse.Namespace) -> int:
    try:
        opts = schema.apply_arguments(CheckOptions(), args)
        run = check(opts.app, args.run_config, local=not opts.deployment)
    except ConfigError as exc:
        print(f"flwr-sharded check: error: {exc}", file=sys.stderr)
        return 2
    print(f"run config OK: {run_summary(run)}")
    return 0
