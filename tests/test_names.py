"""A name finds one thing: every class, function and constant at module level in flwr_sharded/ and flwr_sharded_perf/
is defined in one module only, apart from the entry points' `main`, the sub-commands' `register(subparsers)`,
`__all__` and the module loggers."""

from __future__ import annotations

import ast
from collections import defaultdict

from tests import PACKAGES, REPO

EVERY_MODULE = {"__all__", "log", "logger", "main"}
"""Names every module may define for itself: its exports, its logger, an entry point's `main`."""


def _defined(tree: ast.Module) -> list[str]:
    """The names a module defines at its top level; a sub-command's `register(subparsers)` left out."""
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not (node.name == "register" and [a.arg for a in node.args.args] == ["subparsers"]):
                names.append(node.name)
        elif isinstance(node, ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [name for name in names if name not in EVERY_MODULE]


def defined_twice() -> dict[str, list[str]]:
    """Each name defined at module level in more than one module of the packages, with those modules."""
    where: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for name in _defined(ast.parse(path.read_text(), filename=str(path))):
                where[name].append(path.relative_to(REPO).as_posix())
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_no_module_level_name_is_defined_twice():
    assert defined_twice() == {}


def test_the_scan_finds_a_name_defined_twice():
    """The scan sees functions, classes and constants, and spares only `register(subparsers)` of the registers."""
    one = ast.parse("X = 1\ndef f(): pass\nclass C: pass\ndef register(subparsers): pass\nlog = None\n")
    assert _defined(one) == ["X", "f", "C"]
    assert _defined(ast.parse("def register(cls): pass\ny: int = 2\n")) == ["register", "y"]
