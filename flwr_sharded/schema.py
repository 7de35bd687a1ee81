"""The option schema: every option is one dataclass field with a docstring under it, and nothing else declares it.

Configuration dataclasses (`flwr_sharded.config.TrainConfig`, `flwr_sharded.flower.run_config.FlowerRun`) nest one level
of sections. Each leaf field is an option with a flat, kebab-case name (the field name with '-', unless `option(name=...)`
says otherwise) that is unique in its tree. From the fields come:

- the command line (`add_arguments` / `apply_arguments`): `--<name>`, help from the docstring, choices from `Literal`
  types, `--x/--no-x` for booleans;
- YAML files (`from_nested` / `to_nested`): sections as mappings, fields under their own names;
- flat key-value sources such as Flower's run config (`from_flat` / `to_flat`): the flat names, where an empty string
  leaves an optional option unset (TOML has no null);
- the docs' option tables (`options`, `Option.summary`).

A field may declare the same option as a field of another tree (`same_as`): a tool's `--sync-fragments` is the
trainer's, with its docstring, bounds and (unless the tool sizes it otherwise) its default.

Values are checked on the way in (`Option.check`): the type, finiteness of floats and the bounds declared with
`option(ge=..., gt=..., le=..., lt=...)`; every message names the option as the source spells it (a `Surface`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import re
import textwrap
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterable, Literal, Mapping, Union

from flwr_sharded.errors import ConfigError

META = "flwr_sharded"
"""Key of an option's settings in `dataclasses.field(metadata=...)`."""


def option(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, name: str | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           not_flat: str | None = None, required: bool = False, hidden: bool = False) -> Any:
    """A dataclass field that is an option: its default, flat name and numeric bounds.

    `not_flat`: why this option is not among the flat keys (the Flower run config); the docs show the reason.
    `required`: the command line must give it (its default, None, is only the unset value of the dataclass).
    `hidden`: left out of `--help` and the docs (test-only switches).
    """
    meta = {"name": name, "ge": ge, "gt": gt, "le": le, "lt": lt, "not_flat": not_flat, "required": required,
            "hidden": hidden}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={META: meta})
    return dataclasses.field(default=default, metadata={META: meta})


def same_as(cls: type, field_name: str, *, default: Any = MISSING, name: str | None = None,
            required: bool = False) -> Any:
    """A field declaring the option `field_name` of dataclass `cls` again: its flag name, bounds and docstring (a
    docstring under the new field replaces it), and its default unless `default` is given (a tool that sizes the
    option for its own runs). The new field repeats the type (`X | None` when `default` is None); its own name may
    differ (the code's), the flag stays the source's unless `name` is given. `required`: as in `option`."""
    source = {f.name: f for f in dataclasses.fields(cls)}[field_name]
    meta = {**source.metadata.get(META, {}), "same_as": (cls, field_name)}
    meta["name"] = name or meta.get("name") or field_name.replace("_", "-")
    meta["required"] = required or meta.get("required", False)
    if default is MISSING:
        if source.default_factory is not MISSING:
            return dataclasses.field(default_factory=source.default_factory, metadata={META: meta})
        default = source.default
    return dataclasses.field(default=default, metadata={META: meta})


@dataclass(frozen=True)
class Surface:
    """How one configuration source spells an option in error messages."""

    label: Callable[[Option], str]
    """The option's name as the user typed it there (e.g. `--lr`, `'lr'`, `'optim.lr'`)."""
    prefix: str = ""
    """Put before every message (e.g. `run config `)."""

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.prefix}{message}")


CLI = Surface(lambda o: f"--{o.name}")
"""Command-line flags."""


def yaml_surface(where: str) -> Surface:
    """Keys of a YAML file, by their dotted path."""
    return Surface(lambda o: f"'{o.key}'", f"{where}: ")


@dataclass(frozen=True)
class Option:
    """One leaf field of a configuration tree."""

    name: str
    """Flat kebab-case name: the command-line flag without `--`, the run-config key."""
    path: tuple[str, ...]
    """Section and field names from the root, e.g. ("optim", "lr")."""
    kind: type
    """int, float, bool or str."""
    optional: bool
    """None is allowed (and is the unset value)."""
    choices: tuple[Any, ...] | None
    """The allowed values, for `Literal` types."""
    default: Any
    """The default of the tree this option was read from."""
    doc: str
    """The docstring under the field."""
    bounds: tuple[tuple[str, float], ...]
    """(operator, value) pairs among ge, gt, le, lt."""
    not_flat: str | None
    """Why this option is not a flat key (the Flower run config), or None if it is one."""
    required: bool = False
    """The command line must give it."""
    hidden: bool = False
    """Left out of `--help` and the docs."""
    many: bool = False
    """A list of `kind` values (`list[int]`, `list[str]`), each checked; for messages between programs, not for the
    command line."""

    @property
    def flat(self) -> bool:
        """Part of flat key-value sources (the Flower run config)."""
        return self.not_flat is None

    @property
    def key(self) -> str:
        """Dotted path, as in YAML: `optim.lr`."""
        return ".".join(self.path)

    @property
    def summary(self) -> str:
        """The docstring's first sentence."""
        text = " ".join(self.doc.split())
        parts = re.split(r"(?<!\be\.g)(?<!\bi\.e)\.\s+(?=\S)", text, maxsplit=1)
        return parts[0] if len(parts) == 1 else parts[0] + "."

    def type_name(self) -> str:
        base = "|".join(map(repr, self.choices)) if self.choices else self.kind.__name__
        base = f"list[{base}]" if self.many else base
        return f"{base} | None" if self.optional else base

    def check(self, value: Any, surface: Surface = CLI, *, empty_is_unset: bool = False) -> Any:
        """`value` converted to this option's type, or a ConfigError naming the option."""
        if self.many and value is not None:
            if not isinstance(value, (list, tuple)):
                raise surface.error(f"{surface.label(self)} must be a list of {self.kind.__name__}, got {value!r}")
            one = dataclasses.replace(self, many=False, optional=False)
            return [one.check(v, surface) for v in value]
        label = surface.label(self)
        if value is None or (empty_is_unset and value == "" and self.kind is not str):
            if self.optional:
                return None
            raise surface.error(f"{label} needs a value of type {self.kind.__name__}")
        if empty_is_unset and value == "" and self.optional:
            return None
        converted = _convert(value, self.kind)
        if converted is None:
            raise surface.error(f"{label} must be of type {self.kind.__name__}, got {value!r}")
        value = converted
        if self.kind is float and not math.isfinite(value):
            raise surface.error(f"{label} must be a finite number, got {value}")
        if self.choices is not None and value not in self.choices:
            raise surface.error(f"{label} must be one of {', '.join(map(str, self.choices))}; got {value!r}")
        if any(not _OPS[op][0](value, bound) for op, bound in self.bounds):
            what = "an integer " if self.kind is int else ""
            raise surface.error(f"{label} must be {what}{self.range_text()}, got {value!r}")
        return value

    def range_text(self) -> str:
        """The bounds as `>= 1`, `> 0` or an interval such as `in [0, 1)`."""
        bounds = dict(self.bounds)
        low = next(((op, bounds[op]) for op in ("ge", "gt") if op in bounds), None)
        high = next(((op, bounds[op]) for op in ("le", "lt") if op in bounds), None)
        if low and high:
            return (f"in {'[' if low[0] == 'ge' else '('}{_num(low[1])}, {_num(high[1])}"
                    f"{']' if high[0] == 'le' else ')'}")
        op, bound = low or high  # type: ignore[misc]
        return f"{_OPS[op][1]} {_num(bound)}"


_OPS: dict[str, tuple[Callable[[Any, float], bool], str]] = {
    "ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"),
    "le": (lambda v, b: v <= b, "<="), "lt": (lambda v, b: v < b, "<")}


class _Raw:
    """A command-line value that failed conversion, kept so the message can show it."""

    def __init__(self, value: str) -> None:
        self.value = value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _convert(value: Any, kind: type) -> Any:
    """Convert a YAML/TOML/CLI scalar to `kind`; None if it is not one (bools are never numbers)."""
    if isinstance(value, bool):
        return value if kind is bool else None
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return None
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return None
    if kind is float:
        if isinstance(value, (int, float)):
            return float(value)
        return None
    return value if isinstance(value, kind) else None


# --------------------------------------------------------------------------------------------- walking the tree

@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string literal right after its annotation)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _leaf_type(annotation: Any) -> tuple[type, bool, tuple[Any, ...] | None, bool]:
    """(kind, optional, choices, many) of a leaf annotation: int, float, bool, str, Literal[...], list[X],
    X | None."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (Union, getattr(__import__("types"), "UnionType", Union)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"unsupported option type {annotation!r}")
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if origin is list:
        kind, _, choices, _ = _leaf_type(typing.get_args(annotation)[0])
        return kind, optional, choices, True
    if origin is Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), optional, choices, False
    if annotation in (int, float, bool, str):
        return annotation, optional, None, False
    raise TypeError(f"unsupported option type {annotation!r}")


def is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


def options(root: Any) -> list[Option]:
    """Every leaf option of a configuration tree: a dataclass, or an instance of one (whose values are then the
    defaults reported)."""
    if isinstance(root, type):
        return list(_options(root))
    return [dataclasses.replace(o, default=get(root, o.path)) for o in _options(type(root))]


def _field_default(f: dataclasses.Field) -> Any:
    """A field's default (made by its factory), or MISSING for a field the constructor needs."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


@functools.cache
def _options(cls: type) -> tuple[Option, ...]:
    out: list[Option] = []
    try:
        instance = cls()
    except TypeError:  # fields without defaults (a message's): the defaults come from the fields
        instance = None

    def walk(klass: type, obj: Any, path: tuple[str, ...]) -> None:
        hints = typing.get_type_hints(klass)
        docs = field_docs(klass)
        for f in dataclasses.fields(klass):
            annotation = hints[f.name]
            default = getattr(obj, f.name) if obj is not None else _field_default(f)
            if is_section(annotation):
                walk(annotation, default, (*path, f.name))
                continue
            kind, optional, choices, many = _leaf_type(annotation)
            meta = dict(f.metadata.get(META, {}))
            bounds = tuple((op, meta[op]) for op in ("ge", "gt", "le", "lt") if meta.get(op) is not None)
            source = meta.get("same_as")
            doc = docs.get(f.name) or (field_docs(source[0]).get(source[1], "") if source else "")
            out.append(Option(name=meta.get("name") or f.name.replace("_", "-"), path=(*path, f.name), kind=kind,
                              optional=optional, choices=choices, default=default, doc=doc,
                              bounds=bounds, not_flat=meta.get("not_flat"), required=bool(meta.get("required")),
                              hidden=bool(meta.get("hidden")), many=many))

    walk(cls, instance, ())
    names = [o.name for o in out]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TypeError(f"{cls.__name__}: option names {duplicates} are declared twice")
    return tuple(out)


def by_name(root: Any) -> dict[str, Option]:
    return {o.name: o for o in options(root)}


def get(obj: Any, path: Iterable[str]) -> Any:
    for part in path:
        obj = getattr(obj, part)
    return obj


def put(obj: Any, path: tuple[str, ...], value: Any) -> None:
    setattr(get(obj, path[:-1]), path[-1], value)


# ------------------------------------------------------------------------------------------------ sources

def to_nested(obj: Any) -> dict[str, Any]:
    """Sections as dicts, leaves as values (the YAML and JSON layout)."""
    return dataclasses.asdict(obj)


def from_nested(cls: type, data: Any, surface: Surface, base: Any = None) -> Any:
    """Build `cls` from a nested mapping (YAML/JSON layout) over `base` (default: `cls()`); unknown keys and
    values of the wrong type are ConfigErrors naming the key."""
    obj = base if base is not None else cls()
    _fill(obj, data, surface, ())
    return obj


def _fill(obj: Any, data: Any, surface: Surface, path: tuple[str, ...]) -> None:
    where = ".".join(path) or "the top level"
    if not isinstance(data, Mapping):
        raise surface.error(f"{where} must be a mapping, got {type(data).__name__}")
    klass = type(obj)
    hints = typing.get_type_hints(klass)
    fields = {f.name: f for f in dataclasses.fields(klass)}
    leaves = {o.path[-1]: o for o in options(klass) if o.path[:-1] == ()}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in fields:
            raise surface.error(f"unknown key '{'.'.join((*path, str(raw_key)))}' in {where}; allowed: "
                                f"{', '.join(sorted(fields))}")
        if is_section(hints[key]):
            _fill(getattr(obj, key), value, surface, (*path, key))
        else:
            leaf = leaves[key]
            shown = dataclasses.replace(leaf, path=(*path, key))
            setattr(obj, key, shown.check(value, surface))


def from_flat(root: Any, values: Mapping[str, Any], surface: Surface, *, empty_is_unset: bool = True,
              ignore: Iterable[str] = ()) -> Any:
    """Set options of `root` (an instance, changed in place and returned) from flat names; an unknown name is a
    ConfigError that lists the closest known ones. Names in `ignore` are skipped."""
    known = {o.name: o for o in options(root) if o.flat}
    skipped = set(ignore)
    for name, value in values.items():
        if name in skipped:
            continue
        opt = known.get(name)
        if opt is None:
            import difflib

            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise surface.error(f"unknown key '{name}'{hint}")
        put(root, opt.path, opt.check(value, surface, empty_is_unset=empty_is_unset))
    return root


def to_flat(obj: Any, *, unset: Any = None) -> dict[str, Any]:
    """Flat name -> value of every flat option; unset optional options become `unset`."""
    out = {}
    for o in options(obj):
        if o.flat:
            value = get(obj, o.path)
            out[o.name] = unset if value is None else value
    return out


# --------------------------------------------------------------------------------------------- command line

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` of every entry point: the description as written, and every option's default (schema options
    carry theirs in their help; a plain option with a default other than None or False gets `(default: X)`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (text is None or text == argparse.SUPPRESS or "%(default)" in text or "(default:" in text
                or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def help_text(o: Option) -> str:
    """An option's `--help` line: the docstring's first sentence and the default (or that it is required)."""
    shown = "required" if o.required else f"default: {'unset' if o.default is None else o.default}"
    return f"{o.summary} ({shown})"


def add_arguments(parser: Any, root: Any, *, skip: Iterable[str] = ()) -> None:
    """One `--<name>` per option of `root` (a dataclass or an instance, whose values are shown as defaults), grouped
    by section (described by the section's docstring); every value arrives as given (None when absent) and is
    checked by `apply_arguments`. Each argparse action keeps its option as `action.option`."""
    skipped = set(skip)
    groups: dict[tuple[str, ...], Any] = {}
    klass = root if isinstance(root, type) else type(root)
    for o in options(root):
        if o.name in skipped:
            continue
        section = o.path[:-1]
        if section not in groups:
            groups[section] = parser.add_argument_group(
                section[-1], field_docs(klass).get(section[0]) if len(section) == 1 else None) if section else parser
        shown = argparse.SUPPRESS if o.hidden else help_text(o).replace("%", "%%")
        dest = "opt_" + o.name.replace("-", "_")
        if o.kind is bool:
            action = groups[section].add_argument(f"--{o.name}", dest=dest, action=argparse.BooleanOptionalAction,
                                                  default=None, help=shown, required=o.required)
        else:
            metavar = ("{" + ",".join(map(str, o.choices)) + "}" if o.choices
                       else {str: "TEXT"}.get(o.kind, o.kind.__name__.upper()))
            action = groups[section].add_argument(f"--{o.name}", dest=dest, default=None, metavar=metavar,
                                                  help=shown, type=_cli_type(o.kind), required=o.required)
        action.option = o


def _cli_type(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if kind is int:
            try:
                return int(text)
            except ValueError:
                return _Raw(text)
        if kind is float:
            try:
                return float(text)
            except ValueError:
                return _Raw(text)
        return text

    return parse


def apply_arguments(obj: Any, namespace: Any, surface: Surface = CLI) -> Any:
    """Set the options given on the command line (see `add_arguments`) on `obj`, checked."""
    for o in options(obj):
        dest = "opt_" + o.name.replace("-", "_")
        value = getattr(namespace, dest, None)
        if value is None:
            continue
        if isinstance(value, _Raw):
            raise surface.error(f"{surface.label(o)} must be of type {o.kind.__name__}, got {value.value!r}")
        put(obj, o.path, o.check(value, surface))
    return obj

