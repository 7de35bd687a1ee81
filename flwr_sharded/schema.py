"""The option schema: every option is one dataclass field with a docstring under it, and nothing else declares it.

Dataclasses nest one level of sections; each leaf field is an option with a flat kebab-case name, unique in its tree,
from which come the command line (`add_arguments`), YAML files (`from_nested`), flat sources such as Flower's run
config (`from_flat`; an empty string leaves an optional option unset) and the docs (`options`). `same_as` declares an
option of another tree again. Values are checked on the way in (`Option.check`), each message naming the option as
the source spells it (a `Surface`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterable, Literal, Mapping, Union

from flwr_sharded.errors import ConfigError

META = "flwr_sharded"
"""Key of an option's settings in `dataclasses.field(metadata=...)`."""


def _field(default: Any, factory: Callable[[], Any] | None, meta: dict[str, Any]) -> Any:
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={META: meta})
    return dataclasses.field(default=default, metadata={META: meta})


def option(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, name: str | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           not_flat: str | None = None, required: bool = False, facts: Mapping[str, str] | None = None) -> Any:
    """A dataclass field that is an option: its default, flat name and numeric bounds.

    `not_flat`: why this option is not among the flat keys (the Flower run config); the docs show the reason.
    `required`: the command line must give it (its default, None, is only the unset value of the dataclass).
    `facts`: the values of the docstring's `{name}` placeholders (what another module declares: the wires, the rules).
    """
    return _field(default, factory, {"name": name, "ge": ge, "gt": gt, "le": le, "lt": lt, "not_flat": not_flat,
                                     "required": required, "facts": facts})


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
    factory = source.default_factory if default is MISSING and source.default_factory is not MISSING else None
    return _field(source.default if default is MISSING else default, factory, meta)


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


_OPS: dict[str, tuple[Callable[[Any, float], bool], str]] = {
    "ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"),
    "le": (lambda v, b: v <= b, "<="), "lt": (lambda v, b: v < b, "<")}


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
    many: bool = False
    """A list of `kind` values, each checked (for messages between programs, not for the command line)."""

    @property
    def flat(self) -> bool:
        """Part of flat key-value sources (the Flower run config)."""
        return self.not_flat is None

    @property
    def key(self) -> str:
        """Dotted path, as in YAML: `optim.lr`."""
        return ".".join(self.path)

    @property
    def dest(self) -> str:
        """The argparse destination of its flag (`add_arguments`)."""
        return "opt_" + self.name.replace("-", "_")

    @property
    def metavar(self) -> str:
        return "{" + ",".join(map(str, self.choices)) + "}" if self.choices else {str: "TEXT"}.get(
            self.kind, self.kind.__name__.upper())

    @property
    def summary(self) -> str:
        """The docstring's first sentence."""
        parts = re.split(r"(?<!\be\.g)(?<!\bi\.e)\.\s+(?=\S)", " ".join(self.doc.split()), maxsplit=1)
        return parts[0] if len(parts) == 1 else parts[0] + "."

    def type_name(self) -> str:
        base = "|".join(map(repr, self.choices)) if self.choices else self.kind.__name__
        base = f"list[{base}]" if self.many else base
        return f"{base} | None" if self.optional else base

    def check(self, value: Any, surface: Surface = CLI, *, empty_is_unset: bool = False) -> Any:
        """`value` converted to this option's type, or a ConfigError naming the option."""
        label, kind = surface.label(self), self.kind.__name__
        if self.many and value is not None:
            if not isinstance(value, (list, tuple)):
                raise surface.error(f"{label} must be a list of {kind}, got {value!r}")
            one = dataclasses.replace(self, many=False, optional=False)
            return [one.check(v, surface) for v in value]
        if value is None or (empty_is_unset and value == "" and (self.optional or self.kind is not str)):
            if self.optional:
                return None
            raise surface.error(f"{label} needs a value of type {kind}")
        converted = _convert(value, self.kind)
        if converted is None:
            raise surface.error(f"{label} must be of type {kind}, got {value!r}")
        if self.kind is float and not math.isfinite(converted):
            raise surface.error(f"{label} must be a finite number, got {converted}")
        if self.choices is not None and converted not in self.choices:
            raise surface.error(f"{label} must be one of {', '.join(map(str, self.choices))}; got {converted!r}")
        if any(not _OPS[op][0](converted, bound) for op, bound in self.bounds):
            raise surface.error(f"{label} must be {'an integer ' if self.kind is int else ''}{self.range_text()}, "
                                f"got {converted!r}")
        return converted

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


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _convert(value: Any, kind: type) -> Any:
    """Convert a YAML/TOML/CLI scalar to `kind`; None if it is not one (bools are never numbers)."""
    if isinstance(value, bool):
        return value if kind is bool else None
    if kind is bool:
        return value.lower() == "true" if isinstance(value, str) and value.lower() in ("true", "false") else None
    if kind is int:
        return int(value) if isinstance(value, int) or (isinstance(value, float) and value.is_integer()) else None
    if kind is float:
        return float(value) if isinstance(value, (int, float)) else None
    return value if isinstance(value, kind) else None


# --------------------------------------------------------------------------------------------- walking the tree

@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string literal right after its annotation), its `facts`
    filled in."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        except (OSError, TypeError):
            continue
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    for f in dataclasses.fields(cls):
        facts = f.metadata.get(META, {}).get("facts")
        if facts and f.name in docs:
            docs[f.name] = docs[f.name].format(**facts)
    return docs


def _leaf_type(annotation: Any) -> tuple[type, bool, tuple[Any, ...] | None, bool]:
    """(kind, optional, choices, many) of a leaf annotation: int, float, bool, str, Literal[...], list[X],
    X | None."""
    optional = False
    if typing.get_origin(annotation) in (Union, types.UnionType):
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


@functools.cache
def _options(cls: type) -> tuple[Option, ...]:
    out: list[Option] = []
    try:
        instance = cls()
    except TypeError:  # fields without defaults (a message's): the defaults come from the fields
        instance = None

    def walk(klass: type, obj: Any, path: tuple[str, ...]) -> None:
        hints, docs = typing.get_type_hints(klass), field_docs(klass)
        for f in dataclasses.fields(klass):
            if obj is not None:
                default = getattr(obj, f.name)
            else:
                default = f.default_factory() if f.default_factory is not MISSING else f.default
            if is_section(hints[f.name]):
                walk(hints[f.name], default, (*path, f.name))
                continue
            kind, optional, choices, many = _leaf_type(hints[f.name])
            meta = f.metadata.get(META, {})
            source = meta.get("same_as")
            out.append(Option(name=meta.get("name") or f.name.replace("_", "-"), path=(*path, f.name), kind=kind,
                              optional=optional, choices=choices, default=default,
                              doc=docs.get(f.name) or (field_docs(source[0]).get(source[1], "") if source else ""),
                              bounds=tuple((op, meta[op]) for op in _OPS if meta.get(op) is not None),
                              not_flat=meta.get("not_flat"), required=bool(meta.get("required")), many=many))

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
    hints, names = typing.get_type_hints(type(obj)), sorted(f.name for f in dataclasses.fields(obj))
    leaves = {o.path[-1]: o for o in options(type(obj)) if len(o.path) == 1}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in names:
            raise surface.error(f"unknown key '{'.'.join((*path, str(raw_key)))}' in {where}; allowed: "
                                f"{', '.join(names)}")
        if is_section(hints[key]):
            _fill(getattr(obj, key), value, surface, (*path, key))
        else:
            setattr(obj, key, dataclasses.replace(leaves[key], path=(*path, key)).check(value, surface))


def from_flat(root: Any, values: Mapping[str, Any], surface: Surface, *, empty_is_unset: bool = True,
              ignore: Iterable[str] = ()) -> Any:
    """Set options of `root` (an instance, changed in place and returned) from flat names; an unknown name is a
    ConfigError that lists the closest known ones. Names in `ignore` are skipped."""
    known, skipped = {o.name: o for o in options(root) if o.flat}, set(ignore)
    for name, value in values.items():
        if name in skipped:
            continue
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            raise surface.error(f"unknown key '{name}'" + (f"; did you mean {', '.join(close)}?" if close else ""))
        put(root, known[name].path, known[name].check(value, surface, empty_is_unset=empty_is_unset))
    return root


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
    groups: dict[tuple[str, ...], Any] = {(): parser}
    klass, skipped = root if isinstance(root, type) else type(root), set(skip)
    for o in options(root):
        if o.name in skipped:
            continue
        section = o.path[:-1]
        if section not in groups:
            groups[section] = parser.add_argument_group(section[-1], field_docs(klass).get(section[0])
                                                        if len(section) == 1 else None)
        kwargs: dict[str, Any] = dict(dest=o.dest, default=None, required=o.required,
                                      help=help_text(o).replace("%", "%%"))
        if o.kind is bool:
            action = groups[section].add_argument(f"--{o.name}", action=argparse.BooleanOptionalAction, **kwargs)
        else:
            action = groups[section].add_argument(f"--{o.name}", metavar=o.metavar, type=_cli_type(o.kind), **kwargs)
        action.option = o


def _cli_type(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return kind(text) if kind in (int, float) else text
        except ValueError:
            return text  # `Option.check` refuses it, naming the option

    return parse


def apply_arguments(obj: Any, namespace: Any, surface: Surface = CLI) -> Any:
    """Set the options given on the command line (see `add_arguments`) on `obj`, checked."""
    for o in options(obj):
        if getattr(namespace, o.dest, None) is not None:
            put(obj, o.path, o.check(getattr(namespace, o.dest), surface))
    return obj
