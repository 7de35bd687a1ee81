"""The schema's options (`flwr_sharded.schema`) in the plain argparse command lines of tools and scripts: one option
as a plain argument (`add_option`), a parser mixing both (`parse_args`), a comma-separated value (`split_list`)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING
from typing import Any, Iterable, Sequence

from flwr_sharded import schema
from flwr_sharded.errors import ConfigError


def split_list(text: str, label: str, kind: type = str, allowed: Iterable[Any] | None = None) -> list[Any]:
    """A comma-separated option value (`1,2,4`, `fsdp,hsdp`) as a list of `kind`: every item converted, ints >= 1,
    each among `allowed` when given; ConfigError naming the option `label` (e.g. `--methods`) otherwise."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        values = [kind(x) for x in items]
    except ValueError:
        raise ConfigError(f"{label}: expected {kind.__name__} values separated by commas, got {text!r}") from None
    choices = None if allowed is None else tuple(allowed)
    if not values or (choices is not None and any(v not in choices for v in values)):
        among = f"choose among {','.join(map(str, choices))}" if choices else "give at least one value"
        raise ConfigError(f"{label}: {among}, got {text!r}")
    if kind is int and any(v < 1 for v in values):
        raise ConfigError(f"{label}: expected integers >= 1, got {text!r}")
    return values


def parse_args(parser: argparse.ArgumentParser, root: type, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args` for a parser holding `add_arguments(parser, root)` and plain arguments of its own: every
    option of dataclass `root` checked and set under its field name (a bad value is the parser's usage error, naming
    the flag); the plain arguments as argparse gives them."""
    namespace = parser.parse_args(argv)
    obj = root()
    try:
        schema.apply_arguments(obj, namespace)
    except ConfigError as exc:
        parser.error(str(exc))
    for o in schema.options(obj):
        vars(namespace).pop(o.dest, None)
        setattr(namespace, o.path[-1], schema.get(obj, o.path))
    return namespace


def add_option(parser: Any, cls: type, field_name: str, *, default: Any = MISSING,
               required: bool = False) -> argparse.Action:
    """One top-level option of dataclass `cls` as a plain argparse argument (`args.<field_name>`, a script's use):
    its flag, its help (docstring and default), and its type, choices and bounds checked as it is parsed; `default`
    sizes it for the script."""
    o = next(o for o in schema.options(cls) if o.path == (field_name,))
    o = dataclasses.replace(o, default=o.default if default is MISSING else default, required=required)

    def parse(text: str) -> Any:
        try:
            value = o.kind(text) if o.kind in (int, float) else text
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be of type {o.kind.__name__}, got {text!r}") from None
        try:
            return o.check(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    kwargs: dict[str, Any] = dict(dest=field_name, default=o.default, required=required,
                                  help=schema.help_text(o).replace("%", "%%"))
    if o.kind is bool:
        action = parser.add_argument(f"--{o.name}", action=argparse.BooleanOptionalAction, **kwargs)
    else:
        action = parser.add_argument(f"--{o.name}", type=parse, metavar=o.metavar, **kwargs)
    action.option = o
    return action
